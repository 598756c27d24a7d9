package main

import (
	"bytes"
	"context"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/qvd/qvd/launch"
)

// TestLaunchBlame runs a 3-process job under qvd launch and stops (SIGSTOP) or kills
// (SIGKILL) rank 1 mid-training. The survivors fail first, naming rank 1; the launcher's
// headline must name rank 1 — "not responding" when stopped, "died" when killed — and not
// the survivor that happened to exit first.
func TestLaunchBlame(t *testing.T) {
	needDataset(t)
	t.Setenv(asQVD, "1")
	cfg := filepath.Join(t.TempDir(), "cfg.yaml")
	// A short collective timeout, so the survivors give up on a silent rank in seconds.
	os.WriteFile(cfg, []byte("collective:\n  timeout: 2s\n"), 0o644)
	for _, c := range []struct {
		sig  syscall.Signal
		want string
	}{
		{syscall.SIGSTOP, "qvd launch: rank 1 not responding (its process is stopped"},
		{syscall.SIGKILL, "qvd launch: rank 1 died (killed by SIGKILL)"},
	} {
		t.Run(launch.SignalName(c.sig), func(t *testing.T) {
			out := t.TempDir()
			ctx, cancel := context.WithCancel(context.Background())
			defer cancel()
			signalled := make(chan time.Time, 1)
			go func() {
				defer close(signalled)
				// Once training is under way (rank 0 wrote a few metrics), signal rank 1.
				for i := 0; i < 1200 && ctx.Err() == nil; i++ {
					if b, err := os.ReadFile(filepath.Join(out, "metrics.jsonl")); err == nil && bytes.Count(b, []byte("\n")) >= 3 {
						pid := childWithArg(t, "launch-001")
						if pid == 0 {
							break
						}
						t.Cleanup(func() { syscall.Kill(pid, syscall.SIGKILL); syscall.Kill(pid, syscall.SIGCONT) })
						if err := syscall.Kill(pid, c.sig); err != nil {
							t.Errorf("signal rank 1 (pid %d): %v", pid, err)
						}
						signalled <- time.Now()
						return
					}
					time.Sleep(100 * time.Millisecond)
				}
				t.Errorf("training never got under way")
				cancel()
			}()
			var so, se bytes.Buffer
			code := run(ctx, []string{"launch", "--nproc", "3", "-c", cfg, "--out", out, "--max-steps", "100000", "--epochs", "1000",
				"--train-subset", "512", "--test-subset", "200", "--transport", "tcp", "--quiet"}, &so, &se)
			at, ok := <-signalled
			if !ok {
				t.Fatalf("rank 1 was never signalled; exit %d\n%s", code, se.String())
			}
			headline := ""
			for _, l := range strings.Split(se.String(), "\n") {
				if strings.HasPrefix(l, "qvd launch: rank ") {
					headline = l
				}
			}
			t.Logf("exit %d, %v after the %s; headline: %s", code, time.Since(at).Round(time.Millisecond), launch.SignalName(c.sig), headline)
			if code != exitFailure || !strings.HasPrefix(headline, c.want) {
				t.Fatalf("exit %d, headline %q, want exit 1 and %q\nstderr:\n%s", code, headline, c.want, tail(se.String(), 40))
			}
			if took := time.Since(at); took > 60*time.Second {
				t.Errorf("the launch took %v to end after rank 1 was signalled", took)
			}
		})
	}
}

// childWithArg is the pid of a child process of this one with arg among its arguments, or 0.
func childWithArg(t *testing.T, arg string) int {
	t.Helper()
	dirs, _ := os.ReadDir("/proc")
	me := strconv.Itoa(os.Getpid())
	for _, d := range dirs {
		pid, err := strconv.Atoi(d.Name())
		if err != nil {
			continue
		}
		stat, err := os.ReadFile(filepath.Join("/proc", d.Name(), "stat"))
		if err != nil {
			continue
		}
		// "pid (comm) state ppid ...": the ppid is the second field after the last ')'.
		f := strings.Fields(string(stat[bytes.LastIndexByte(stat, ')')+1:]))
		if len(f) < 2 || f[1] != me {
			continue
		}
		cmdline, _ := os.ReadFile(filepath.Join("/proc", d.Name(), "cmdline"))
		for _, a := range strings.Split(string(cmdline), "\x00") {
			if a == arg {
				return pid
			}
		}
	}
	return 0
}

func tail(s string, n int) string {
	lines := strings.Split(s, "\n")
	if len(lines) > n {
		lines = lines[len(lines)-n:]
	}
	for i, l := range lines {
		if len(l) > 400 {
			lines[i] = l[:400] + "…"
		}
	}
	return strings.Join(lines, "\n")
}
