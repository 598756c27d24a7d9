package main

import (
	"os"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/qvd/qvd/checkpoint"
)

// TestPreemptSIGUSR1 (ecosystem item 3): SIGUSR1, which `sbatch --signal=USR1@60` sends before
// the time limit, stops `qvd train` at the next step boundary with a checkpoint and exit code
// exitPreempted (138); `--resume auto`, as the requeued job runs it, continues from that step.
func TestPreemptSIGUSR1(t *testing.T) {
	needDataset(t)
	if exitPreempted != 138 {
		t.Fatalf("exitPreempted = %d: the documented code (README, qvd.sbatch) is 138", exitPreempted)
	}
	out := t.TempDir()
	args := []string{"train", "--out", out, "--epochs", "1000", "--max-steps", "100000", "--train-subset", "512", "--test-subset", "200", "--quiet"}
	cmd, o := qvdCmd(t, hardeningKey, args...)
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
	cmd.Process.Signal(syscall.SIGUSR1)
	code := exitWithin(t, "train", done, 60*time.Second, o)
	if code != exitPreempted || !strings.Contains(o.String(), "interrupted at step") || !strings.Contains(o.String(), "SIGUSR1") {
		t.Fatalf("train after SIGUSR1: exit %d, want %d, a checkpoint and the signal named:\n%s", code, exitPreempted, tail(o.String(), 30))
	}
	ck, skipped, err := checkpoint.Latest(filepath.Join(out, "checkpoints"))
	if err != nil || len(skipped) > 0 {
		t.Fatalf("no valid checkpoint after SIGUSR1: %v %v", err, skipped)
	}
	m := regexp.MustCompile(`interrupted at step (\d+)`).FindStringSubmatch(o.String())
	if m == nil || m[1] != strconv.FormatInt(ck.Step(), 10) {
		t.Fatalf("stopped at %v, newest checkpoint at step %d", m, ck.Step())
	}

	// The requeued job: the same command with --resume auto, here with a near end.
	more := append(append([]string(nil), args...), "--resume", "auto", "--max-steps", strconv.FormatInt(ck.Step()+2, 10))
	code, stdout, stderr := runQVD(t, more...)
	if code != exitOK {
		t.Fatalf("--resume auto after preemption: exit %d\n%s\n%s", code, stdout, stderr)
	}
	if !regexp.MustCompile(`"start_step": ` + strconv.FormatInt(ck.Step(), 10) + `\b`).MatchString(stderr) {
		t.Fatalf("--resume auto did not continue from step %d:\n%s", ck.Step(), tail(stderr, 30))
	}
	if after, _, err := checkpoint.Latest(filepath.Join(out, "checkpoints")); err != nil || after.Step() != ck.Step()+2 {
		t.Fatalf("after resuming: newest checkpoint %v, %v; want step %d", after, err, ck.Step()+2)
	}
}
