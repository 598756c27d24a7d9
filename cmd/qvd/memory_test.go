package main

import (
	"os"
	"path/filepath"
	"runtime/debug"
	"strings"
	"testing"

	"github.com/qvd/qvd/internal/metrics"
)

func writeConfig(t *testing.T, text string) string {
	t.Helper()
	p := filepath.Join(t.TempDir(), "c.yaml")
	if err := os.WriteFile(p, []byte(text), 0o644); err != nil {
		t.Fatal(err)
	}
	return p
}

// TestMemoryLimitTooLow: a memory.limit below what the MLP's model states need (3.6 MiB of
// fp32 parameters, gradients and AdamW moments) is refused before training, naming the key.
func TestMemoryLimitTooLow(t *testing.T) {
	needDataset(t)
	cfg := writeConfig(t, "run: {name: memlimit}\nmemory: {limit: 2MiB}\n")
	code, stdout, stderr := runQVD(t, "train", "-c", cfg, "--out", t.TempDir(), "--max-steps", "2", "--train-subset", "640", "--test-subset", "100", "--quiet")
	if code == exitOK {
		t.Fatalf("trained under a 2 MiB limit\nstdout:\n%s", stdout)
	}
	for _, want := range []string{"memory.limit is too low", "memory.limit 2MiB", "model states need 3.6 MiB", "optimizer state 1.8 MiB", "set memory.limit to at least"} {
		if !strings.Contains(stderr, want) {
			t.Errorf("stderr does not say %q:\n%s", want, stderr)
		}
	}
	if strings.Contains(stderr, "step 1") {
		t.Errorf("a step ran before the refusal:\n%s", stderr)
	}
}

// TestMemoryLimitSetAndMonitorFigures: an adequate limit is set for the run (and restored
// after, since the test runs qvd in-process), and the monitor's figures reach the metrics.
func TestMemoryLimitSetAndMonitorFigures(t *testing.T) {
	needDataset(t)
	before := debug.SetMemoryLimit(-1)
	out := t.TempDir()
	cfg := writeConfig(t, "run: {name: memlimit}\nmemory: {limit: 4GiB, log_every: 2}\n")
	code, stdout, stderr := runQVD(t, "train", "-c", cfg, "--out", out, "--max-steps", "4", "--train-subset", "640", "--test-subset", "100")
	if code != exitOK {
		t.Fatalf("exit %d\nstdout:\n%s\nstderr:\n%s", code, stdout, stderr)
	}
	for _, want := range []string{"memory limit set", "memory change: model build:", "memory change: trainer build:",
		"memory change: first forward+backward:", "Memory - Allocated: ", "Max Used: "} {
		if !strings.Contains(stderr, want) {
			t.Errorf("log does not have %q:\n%s", want, stderr)
		}
	}
	if after := debug.SetMemoryLimit(-1); after != before {
		t.Fatalf("memory limit left at %d (was %d)", after, before)
	}
	recs, err := metrics.ReadFile(filepath.Join(out, "metrics.jsonl"))
	if err != nil {
		t.Fatal(err)
	}
	n := 0
	for _, r := range recs {
		if r.Kind != metrics.KindTrain {
			continue
		}
		n++
		if r.AvailableBytes == 0 || r.MaxHeapBytes == 0 || len(r.PhaseHeap) != 3 {
			t.Fatalf("monitor figures missing: %+v", r)
		}
	}
	if n != 4 {
		t.Fatalf("%d train records", n)
	}
}
