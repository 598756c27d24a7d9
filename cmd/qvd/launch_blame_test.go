package main

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/qvd/qvd/collective"
)

// TestBlamedRank: the launcher finds the rank a worker's final error blames in the formats
// the ranks write: a collective's PeerError (the peer at fault; for an abort, the rank that
// failed first), the gossip watcher's, the rendezvous'.
func TestBlamedRank(t *testing.T) {
	timeout := &collective.PeerError{Rank: 1, Addr: "127.0.0.1:42849", Op: "all-reduce (auto tag 1464)",
		Err: fmt.Errorf("%w: no frame for 2s", collective.ErrTimeout)}
	abort := &collective.PeerError{Rank: 1, Addr: "127.0.0.1:42849", Op: "all-reduce (auto tag 1464)",
		Err: fmt.Errorf("%w (rank 2 failed: %v)", collective.ErrAborted, timeout)}
	gone := &collective.PeerError{Rank: 3, Addr: "127.0.0.1:1", Err: collective.ErrPeerGone}
	for _, c := range []struct {
		line string
		want int
	}{
		{"qvd: training failed: evaluation at step 418: reducing results: " + timeout.Error(), 1},
		{"qvd: training failed: step 9: " + abort.Error(), 1},
		{"qvd: training failed: " + gone.Error(), 3},
		{"qvd: training failed: rank 2 (launch-002 at 127.0.0.1:39627) failed (no longer answers gossip) (collective all-reduce (tag 4): rank 0 (x): context canceled)", 2},
		{"qvd: coordinate: job j gen 7: prepare refused or unanswered: rank 1 (launch-001 at 127.0.0.1:5): context deadline exceeded", 1},
		{"qvd train: invalid configuration: train.precision: must be fp32, fp16 or bf16", -1},
		{"", -1},
	} {
		if got := blamedRank(c.line); got != c.want {
			t.Errorf("blamedRank(%q) = %d, want %d", c.line, got, c.want)
		}
	}
}

// TestFailureReport: the headline names the rank the first failure blames, and what had
// become of it: stopped or alive ("not responding"), killed by a signal ("died"), or exited
// with an error ("failed").
func TestFailureReport(t *testing.T) {
	const blame1 = "qvd: training failed: collective all-reduce (tag 3): rank 1 (127.0.0.1:4): collective: peer timed out: no frame for 2s"
	const blame2 = "qvd: training failed: collective all-reduce (tag 3): rank 2 (127.0.0.1:5): collective: peer timed out: no frame for 2s"
	exited1 := workerExit{done: true, err: errors.New("exit status 1")}
	killed := workerExit{done: true, err: errors.New("signal: killed"), signal: syscall.SIGKILL}
	for _, c := range []struct {
		name      string
		first     int
		firstErr  string
		state1    procState
		exit1     workerExit
		killedBy1 bool
		want, not string
	}{
		{"stopped", 2, blame1, procStopped, exited1, false, "qvd launch: rank 1 not responding (its process is stopped", "rank 2 failed"},
		{"hung", 2, blame1, procRunning, killed, true, "qvd launch: rank 1 not responding (alive", "died"},
		{"killed", 1, "", procExited, killed, false, "qvd launch: rank 1 died (killed by SIGKILL)", "rank 2"},
		{"killed, a survivor first", 2, blame1, procExited, killed, false, "qvd launch: rank 1 died (killed by SIGKILL); rank 2 was the first to fail", "not responding"},
		{"stopped, behind a survivor that blamed a survivor", 0, blame2, procStopped, exited1, false, "qvd launch: rank 1 not responding (its process is stopped", "rank 2 not responding"},
		{"failed on its own", 1, "qvd: training failed: loading data: no such file", procExited, exited1, false, "qvd launch: rank 1 failed (exit status 1)", "rank 2"},
	} {
		t.Run(c.name, func(t *testing.T) {
			ws := make([]*launched, 3)
			for i := range ws {
				ws[i] = &launched{rank: i, atFail: procRunning, exit: workerExit{done: true, err: errors.New("exit status 143")}}
			}
			ws[1].atFail, ws[1].exit, ws[1].killedBy = c.state1, c.exit1, c.killedBy1
			ws[1].last = []string{"rank 1's last words"}
			ws[2].err = blame1 // rank 2, a survivor, failed waiting for rank 1
			first := ws[c.first]
			first.err = c.firstErr
			first.last = []string{c.firstErr}
			first.exit = workerExit{done: true, err: errors.New("exit status 1")}
			if c.first == 1 {
				first.exit = c.exit1
			}
			got := failureReport(first, ws)
			if !strings.Contains(got, c.want) || strings.Contains(got, c.not) {
				t.Errorf("report:\n%s\nwant %q, and not %q", got, c.want, c.not)
			}
		})
	}
}

// TestFailureReportCycle: two survivors of a ring blame each other (each timed out on the link
// it reads); the stopped rank the launcher saw is named, not either of them.
func TestFailureReportCycle(t *testing.T) {
	blame := func(r int) string {
		return fmt.Sprintf("qvd: training failed: collective all-reduce (tag 3): rank %d (127.0.0.1:4): collective: peer timed out: no frame for 2s", r)
	}
	ws := make([]*launched, 3)
	for i := range ws {
		ws[i] = &launched{rank: i, atFail: procRunning, exit: workerExit{done: true, err: errors.New("exit status 1")}}
	}
	ws[0].err, ws[2].err = blame(2), blame(0)
	ws[1].atFail = procStopped
	got := failureReport(ws[0], ws)
	if !strings.Contains(got, "qvd launch: rank 1 not responding (its process is stopped") {
		t.Errorf("report:\n%s\nwant rank 1, stopped", got)
	}
	// A worker the launcher's own SIGTERM killed (before its handler was installed) after the
	// first failure is not "died": the first failure, with an error of its own, is the cause.
	own := make([]*launched, 2)
	for i := range own {
		own[i] = &launched{rank: i, atFail: procRunning, exit: workerExit{done: true, err: errors.New("signal: terminated"), signal: syscall.SIGTERM}}
	}
	own[0].err, own[0].atFail = "qvd train: invalid configuration:", procExited
	own[0].exit = workerExit{done: true, err: errors.New("exit status 2")}
	if got := failureReport(own[0], own); !strings.Contains(got, "qvd launch: rank 0 failed") {
		t.Errorf("report with a SIGTERMed bystander:\n%s\nwant rank 0 failed", got)
	}
	// Without a stopped or killed worker, the cycle ends the search at a rank in it.
	ws[1].atFail = procRunning
	if got := failureReport(ws[0], ws); !strings.Contains(got, "qvd launch: rank ") {
		t.Errorf("report without evidence:\n%s", got)
	}
}

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
		t.Run(signalName(c.sig), func(t *testing.T) {
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
			t.Logf("exit %d, %v after the %s; headline: %s", code, time.Since(at).Round(time.Millisecond), signalName(c.sig), headline)
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
