package main

import (
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/qvd/qvd/job"
	"github.com/qvd/qvd/launch"
)

// hardeningKey is a random cluster key (`qvd keygen`) for the tests below.
const hardeningKey = "2cd622eb8da0e9c1d8a000e35e1931b744f8564c22f38c70e6d8a0bdac2796b2"

// started runs cmd and returns a channel that yields its exit code.
func started(t *testing.T, cmd *exec.Cmd) <-chan int {
	t.Helper()
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	done := make(chan int, 1)
	go func() {
		err := cmd.Wait()
		var ee *exec.ExitError
		switch {
		case err == nil:
			done <- 0
		case errors.As(err, &ee):
			done <- ee.ExitCode()
		default:
			done <- -1
		}
	}()
	t.Cleanup(func() {
		if cmd.ProcessState == nil {
			cmd.Process.Kill()
		}
	})
	return done
}

// waitFor polls until out holds want, or fails the test after d.
func waitFor(t *testing.T, out *syncBuffer, want string, d time.Duration) {
	t.Helper()
	for deadline := time.Now().Add(d); !strings.Contains(out.String(), want); time.Sleep(100 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatalf("no %q after %v:\n%s", want, d, tail(out.String(), 30))
		}
	}
}

func exitWithin(t *testing.T, what string, done <-chan int, d time.Duration, out *syncBuffer) int {
	t.Helper()
	select {
	case code := <-done:
		return code
	case <-time.After(d):
		t.Fatalf("%s still running %v after the signal:\n%s", what, d, tail(out.String(), 30))
	}
	return 0
}

// TestSignalExitCodes: SIGINT exits 130 and SIGTERM 143 (128+signal, as shells report a
// process the signal ended), during training (after a checkpoint, as before) and during the
// rendezvous, on the coordinator and on a worker, with a message that names the signal
// rather than "context canceled".
func TestSignalExitCodes(t *testing.T) {
	needDataset(t)
	for _, sig := range []syscall.Signal{syscall.SIGINT, syscall.SIGTERM} {
		want := 128 + int(sig)
		t.Run("train-"+launch.SignalName(sig), func(t *testing.T) {
			out := t.TempDir()
			cmd, o := qvdCmd(t, hardeningKey, "train", "--out", out, "--epochs", "1000", "--train-subset", "512", "--test-subset", "200", "--quiet")
			done := started(t, cmd)
			for i := 0; ; i++ {
				if b, err := os.ReadFile(filepath.Join(out, "metrics.jsonl")); err == nil && strings.Count(string(b), "\n") >= 3 {
					break
				}
				if i > 600 {
					t.Fatalf("training never got under way:\n%s", tail(o.String(), 30))
				}
				time.Sleep(100 * time.Millisecond)
			}
			cmd.Process.Signal(sig)
			code := exitWithin(t, "train", done, 60*time.Second, o)
			if code != want || !strings.Contains(o.String(), "interrupted at step") {
				t.Fatalf("train after %s: exit %d, want %d and a checkpoint at the step it stopped:\n%s", launch.SignalName(sig), code, want, tail(o.String(), 30))
			}
		})
	}

	// A coordinator waiting for a third member, with one worker waiting for the roster.
	port, err := launch.FreePort("127.0.0.1")
	if err != nil {
		t.Fatal(err)
	}
	coord := fmt.Sprintf("127.0.0.1:%d", port)
	train, to := qvdCmd(t, hardeningKey, "train", "--nodes", "3", "--bind", coord, "--grpc-bind", "127.0.0.1:0", "--node-name", "c0",
		"--out", t.TempDir(), "--train-subset", "512", "--test-subset", "200", "--quiet")
	tdone := started(t, train)
	waitFor(t, to, "waiting for workers", 60*time.Second)
	join, jo := qvdCmd(t, hardeningKey, "join", coord, "--bind", "127.0.0.1:0", "--grpc-bind", "127.0.0.1:0", "--node-name", "c1")
	jdone := started(t, join)
	waitFor(t, jo, "waiting for the coordinator's roster", 60*time.Second)

	for _, c := range []struct {
		what string
		cmd  *exec.Cmd
		out  *syncBuffer
		done <-chan int
		sig  syscall.Signal
	}{{"qvd join", join, jo, jdone, syscall.SIGINT}, {"the coordinator", train, to, tdone, syscall.SIGTERM}} {
		c.cmd.Process.Signal(c.sig)
		code := exitWithin(t, c.what, c.done, 30*time.Second, c.out)
		msg := "interrupted by " + launch.SignalName(c.sig) + " during rendezvous"
		if code != 128+int(c.sig) || !strings.Contains(c.out.String(), msg) || strings.Contains(c.out.String(), "context canceled") {
			t.Errorf("%s after %s in the rendezvous: exit %d, want %d and %q (not \"context canceled\"):\n%s",
				c.what, launch.SignalName(c.sig), code, 128+int(c.sig), msg, tail(c.out.String(), 20))
		}
	}
}

// TestJoinRefusals: `qvd join` fails at once, naming the problem, when its node name is
// taken by a live member (instead of leaving the coordinator to wait out the rendezvous) or
// when the peer is not a qvd node (instead of retrying for two minutes).
func TestJoinRefusals(t *testing.T) {
	web := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { io.WriteString(w, "hello") }))
	defer web.Close()
	peer := strings.TrimPrefix(web.URL, "http://")
	t.Setenv(job.ClusterKeyEnv, hardeningKey)
	start := time.Now()
	code, _, errs := runQVD(t, "join", peer, "--bind", "127.0.0.1:0", "--grpc-bind", "127.0.0.1:0", "--node-name", "w")
	if took := time.Since(start); code != exitFailure || !strings.Contains(errs, peer+" is not a qvd node") || took > 10*time.Second {
		t.Errorf("join an HTTP server: exit %d after %v, want 1 at once saying %q:\n%s", code, took, peer+" is not a qvd node", errs)
	}

	port, err := launch.FreePort("127.0.0.1")
	if err != nil {
		t.Fatal(err)
	}
	coord := fmt.Sprintf("127.0.0.1:%d", port)
	train, to := qvdCmd(t, hardeningKey, "train", "--nodes", "3", "--bind", coord, "--grpc-bind", "127.0.0.1:0", "--node-name", "d0",
		"--out", t.TempDir(), "--quiet")
	tdone := started(t, train)
	defer func() { train.Process.Signal(syscall.SIGTERM); <-tdone }()
	waitFor(t, to, "waiting for workers", 60*time.Second)
	first, fo := qvdCmd(t, hardeningKey, "join", coord, "--bind", "127.0.0.1:0", "--grpc-bind", "127.0.0.1:0", "--node-name", "d1")
	fdone := started(t, first)
	defer func() { first.Process.Signal(syscall.SIGTERM); <-fdone }()
	waitFor(t, fo, "waiting for the coordinator's roster", 60*time.Second)

	for _, name := range []string{"d1", "d0"} {
		start = time.Now()
		code, _, errs = runQVD(t, "join", coord, "--bind", "127.0.0.1:0", "--grpc-bind", "127.0.0.1:0", "--node-name", name)
		want := fmt.Sprintf("node name %q is already taken", name)
		if took := time.Since(start); code != exitFailure || !strings.Contains(errs, want) || took > 15*time.Second {
			t.Errorf("a second node named %s: exit %d after %v, want 1 at once saying %q:\n%s", name, code, took, want, errs)
		}
	}
	// The first d1 is still the coordinator's member: a third node completes the job's world.
	w2, w2o := qvdCmd(t, hardeningKey, "join", coord, "--bind", "127.0.0.1:0", "--grpc-bind", "127.0.0.1:0", "--node-name", "d2")
	w2done := started(t, w2)
	defer func() { w2.Process.Signal(syscall.SIGTERM); <-w2done }()
	waitFor(t, to, "rendezvous complete", 60*time.Second)
	_ = w2o
}
