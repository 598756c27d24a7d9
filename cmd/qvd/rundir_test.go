package main

import (
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/qvd/qvd/checkpoint"
	"github.com/qvd/qvd/rundir"
)

// tinyRun is a training run of a few seconds in out.
func tinyRun(out string, more ...string) []string {
	return append([]string{"train", "--out", out, "--quiet", "--train-subset", "512", "--test-subset", "200", "--epochs", "1"}, more...)
}

// TestRunDirLocked: a second run in a run directory that a running qvd holds is refused with
// an error naming the holder; once the holder is killed (SIGKILL: no clean-up), its lock is
// stale and the next run takes it over with a warning.
func TestRunDirLocked(t *testing.T) {
	needDataset(t)
	out := t.TempDir()
	holder, holderOut := qvdCmd(t, testKey, tinyRun(out, "--epochs", "1000", "--checkpoint-every", "0")...)
	if err := holder.Start(); err != nil {
		t.Fatal(err)
	}
	defer holder.Process.Kill()
	lock := filepath.Join(out, rundir.LockFile)
	for deadline := time.Now().Add(60 * time.Second); ; time.Sleep(20 * time.Millisecond) {
		if b, _ := os.ReadFile(lock); len(b) > 0 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("the first run never took the lock:\n%s", holderOut)
		}
	}
	host, _ := os.Hostname()
	code, _, stderr := runQVD(t, tinyRun(out, "--max-steps", "2")...)
	want := fmt.Sprintf("is in use by another qvd run: pid %d on host %s since ", holder.Process.Pid, host)
	if code != exitFailure || !strings.Contains(stderr, want) {
		t.Fatalf("second run: exit %d, want %d with %q\nstderr:\n%s", code, exitFailure, want, stderr)
	}
	// --resume auto is a second run all the same.
	if code, _, stderr := runQVD(t, tinyRun(out, "--max-steps", "2", "--resume", "auto")...); code != exitFailure || !strings.Contains(stderr, want) {
		t.Fatalf("second run with --resume auto: exit %d\nstderr:\n%s", code, stderr)
	}

	holder.Process.Kill()
	holder.Wait()
	code, stdout, stderr := runQVD(t, tinyRun(out, "--max-steps", "2", "--resume", "auto")...)
	if code != exitOK || !strings.Contains(stderr, "took over a stale run directory lock") || !strings.Contains(stderr, fmt.Sprint(holder.Process.Pid)) {
		t.Fatalf("run after the holder died: exit %d\nstdout:\n%s\nstderr:\n%s", code, stdout, stderr)
	}
	// A clean exit releases the lock: the next run notes nothing.
	if code, _, stderr := runQVD(t, tinyRun(out, "--max-steps", "3", "--resume", "auto")...); code != exitOK || strings.Contains(stderr, "stale") {
		t.Fatalf("run after a clean exit: exit %d\nstderr:\n%s", code, stderr)
	}
}

// TestFreshRunOverAnotherRun: starting fresh where a run has left checkpoints and metrics is
// refused (before: metrics.jsonl truncated, and a later --resume auto picked up the old run);
// --overwrite moves the old run aside and never deletes it; --resume auto then continues the
// new run only.
func TestFreshRunOverAnotherRun(t *testing.T) {
	needDataset(t)
	out := filepath.Join(t.TempDir(), "run")
	if code, _, stderr := runQVD(t, tinyRun(out, "--max-steps", "4")...); code != exitOK {
		t.Fatal(stderr)
	}
	metricsPath := filepath.Join(out, "metrics.jsonl")
	oldMetrics, err := os.ReadFile(metricsPath)
	if err != nil || len(oldMetrics) == 0 {
		t.Fatalf("metrics of the first run: %v", err)
	}
	oldID, _ := checkpoint.ReadRunID(filepath.Join(out, "checkpoints"))

	code, _, stderr := runQVD(t, tinyRun(out, "--max-steps", "2")...)
	if code != exitUsage || !strings.Contains(stderr, "already holds run "+oldID) ||
		!strings.Contains(stderr, "--resume auto") || !strings.Contains(stderr, "--overwrite") {
		t.Fatalf("fresh run over a finished one: exit %d, want %d naming the run and the ways out\nstderr:\n%s", code, exitUsage, stderr)
	}
	if b, _ := os.ReadFile(metricsPath); string(b) != string(oldMetrics) {
		t.Fatalf("the refused run changed metrics.jsonl")
	}
	if code, _, stderr := runQVD(t, tinyRun(out, "--overwrite", "--resume", "auto")...); code != exitUsage {
		t.Fatalf("--overwrite with --resume: exit %d\n%s", code, stderr)
	}

	code, _, stderr = runQVD(t, tinyRun(out, "--max-steps", "2", "--overwrite")...)
	if code != exitOK || !strings.Contains(stderr, "moved the previous run aside") {
		t.Fatalf("--overwrite: exit %d\nstderr:\n%s", code, stderr)
	}
	asides, _ := filepath.Glob(out + ".old-*")
	if len(asides) != 1 {
		t.Fatalf("moved-aside directories %v, want one", asides)
	}
	if b, _ := os.ReadFile(filepath.Join(asides[0], "metrics.jsonl")); string(b) != string(oldMetrics) {
		t.Errorf("the old run's metrics were not moved aside intact")
	}
	if _, err := checkpoint.Open(filepath.Join(asides[0], "checkpoints", "step-00000004")); err != nil {
		t.Errorf("the old run's checkpoint was not moved aside intact: %v", err)
	}
	if steps, _ := checkpoint.List(filepath.Join(out, "checkpoints")); len(steps) != 1 || steps[0] != 2 {
		t.Errorf("the new run's checkpoints: %v, want [2]", steps)
	}
	newID, _ := checkpoint.ReadRunID(filepath.Join(out, "checkpoints"))
	if newID == "" || newID == oldID {
		t.Errorf("run id after --overwrite %q (the old one was %q)", newID, oldID)
	}

	// The new run resumes from its own step 2 (the old run's step 4 is gone from here).
	code, stdout, stderr := runQVD(t, tinyRun(out, "--max-steps", "3", "--resume", "auto")...)
	if code != exitOK || !strings.Contains(stdout, "done: 3 steps") || !strings.Contains(stderr, `"step": 2`) {
		t.Fatalf("--resume auto after --overwrite: exit %d\nstdout:\n%s\nstderr:\n%s", code, stdout, stderr)
	}
	if id, _ := checkpoint.RunIDOf(filepath.Join(out, "checkpoints", "step-00000003")); id != newID {
		t.Errorf("the resumed run's checkpoint has run id %q, want %q (kept across resumes)", id, newID)
	}
}

// TestResumeAutoOnlySameRun: a checkpoint of another run in the checkpoint directory (copied
// there), newer than the run's own, is skipped by --resume auto with a warning.
func TestResumeAutoOnlySameRun(t *testing.T) {
	needDataset(t)
	a, b := t.TempDir(), t.TempDir()
	if code, _, stderr := runQVD(t, tinyRun(a, "--max-steps", "6", "--seed", "9")...); code != exitOK {
		t.Fatal(stderr)
	}
	if code, _, stderr := runQVD(t, tinyRun(b, "--max-steps", "4")...); code != exitOK {
		t.Fatal(stderr)
	}
	if err := os.Rename(filepath.Join(a, "checkpoints", "step-00000006"), filepath.Join(b, "checkpoints", "step-00000006")); err != nil {
		t.Fatal(err)
	}
	code, stdout, stderr := runQVD(t, tinyRun(b, "--max-steps", "5", "--resume", "auto")...)
	if code != exitOK || !strings.Contains(stdout, "done: 5 steps") || !strings.Contains(stderr, `"step": 4`) ||
		!strings.Contains(stderr, "belongs to run") {
		t.Fatalf("--resume auto with another run's newer checkpoint: exit %d\nstdout:\n%s\nstderr:\n%s", code, stdout, stderr)
	}
}

// TestResumeTamperedMeta: a meta.json changed after it was written (the step, the data
// position, the optimizer) is a corrupt checkpoint: named explicitly it is an error naming
// meta.json; --resume auto falls back to the previous valid one at WARN. Before, a step set
// to 1000 gave "done: 1000 steps" and exit 0.
func TestResumeTamperedMeta(t *testing.T) {
	needDataset(t)
	out := t.TempDir()
	if code, _, stderr := runQVD(t, tinyRun(out, "--max-steps", "4")...); code != exitOK {
		t.Fatal(stderr)
	}
	if code, _, stderr := runQVD(t, tinyRun(out, "--max-steps", "8", "--resume", "auto")...); code != exitOK {
		t.Fatal(stderr)
	}
	newest := filepath.Join(out, "checkpoints", "step-00000008")
	metaPath := filepath.Join(newest, "meta.json")
	orig, err := os.ReadFile(metaPath)
	if err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct {
		name  string
		field string
		value any
	}{{"step", "step", 1000}, {"data position", "epoch_offset", 33}, {"optimizer", "optimizer", "sgd"}} {
		var doc map[string]any
		if err := json.Unmarshal(orig, &doc); err != nil {
			t.Fatal(err)
		}
		doc["meta"].(map[string]any)[tc.field] = tc.value
		b, _ := json.MarshalIndent(doc, "", "  ")
		os.WriteFile(metaPath, b, 0o644)
		code, stdout, stderr := runQVD(t, tinyRun(out, "--max-steps", "9", "--resume", newest)...)
		if code != exitFailure || !strings.Contains(stderr, "meta.json: checksum mismatch") {
			t.Fatalf("%s changed, explicit resume: exit %d, want %d naming meta.json\nstdout:\n%s\nstderr:\n%s", tc.name, code, exitFailure, stdout, stderr)
		}
	}
	code, stdout, stderr := runQVD(t, tinyRun(out, "--max-steps", "7", "--resume", "auto")...)
	if code != exitOK || !strings.Contains(stderr, "skipping a checkpoint that failed verification") ||
		!strings.Contains(stderr, `"step": 4`) || !strings.Contains(stdout, "done: 7 steps") {
		t.Fatalf("--resume auto with a tampered newest meta.json: exit %d\nstdout:\n%s\nstderr:\n%s", code, stdout, stderr)
	}
}
