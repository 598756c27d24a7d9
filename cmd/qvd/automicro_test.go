package main

import (
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/qvd/qvd/trainer"
)

// TestAutoMicroBatchCLI: --micro-batch auto at the command line, with this machine's memory
// as the budget (the search itself is job's TestAutoMicroBatch).
func TestAutoMicroBatchCLI(t *testing.T) {
	code, _, errs := runQVD(t, "config", "--micro-batch", "auto")
	if code != exitUsage || !strings.Contains(errs, "effective_batch") {
		t.Errorf("--micro-batch auto alone: exit %d, %s", code, errs)
	}
	code, out, errs := runQVD(t, "config", "--micro-batch", "auto", "--effective-batch", "64")
	if code != exitOK || !strings.Contains(errs, "micro_batch: auto chose") || !strings.Contains(out, "micro_batch: 64") {
		t.Errorf("--micro-batch auto --effective-batch 64: exit %d\n%s\n%s", code, out, errs)
	}
}

// TestMicroBatchFlagNegative: auto is stored as -1, so --micro-batch -1 (or micro_batch: -1
// in the file) used to mean auto. A number below 1 is refused naming the flag or key and the
// value; only the word auto means auto.
func TestMicroBatchFlagNegative(t *testing.T) {
	var p *int
	m := microBatchFlag{&p}
	for _, s := range []string{"-1", "-2", "0", "1048577"} {
		if err := m.Set(s); err == nil || !strings.Contains(err.Error(), "train.micro_batch: must be in [1, 1048576] or auto, got "+s) {
			t.Errorf("Set(%q): %v", s, err)
		}
	}
	if p != nil {
		t.Errorf("a refused Set stored %d", *p)
	}
	if err := m.Set("auto"); err != nil || *p != trainer.AutoMicroBatch || m.String() != "auto" {
		t.Errorf("Set(auto): %v, %v", err, m)
	}
	if err := m.Set("32"); err != nil || *p != 32 {
		t.Errorf("Set(32): %v, %v", err, m)
	}
	code, out, errs := runQVD(t, "config", "--micro-batch", "-1", "--effective-batch", "64")
	if code != exitUsage || !strings.Contains(errs, `invalid value "-1" for flag -micro-batch: train.micro_batch: must be in [1, 1048576] or auto, got -1`) || strings.Contains(errs, "auto chose") {
		t.Errorf("--micro-batch -1: exit %d\n%s\n%s", code, out, errs)
	}
	path := filepath.Join(t.TempDir(), "neg.yaml")
	if err := os.WriteFile(path, []byte("train:\n  micro_batch: -1\n  effective_batch: 64\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	code, out, errs = runQVD(t, "config", "-c", path)
	if code != exitUsage || !strings.Contains(errs, "train.micro_batch (line 2): must be a positive number or auto, got -1") {
		t.Errorf("micro_batch: -1: exit %d\n%s\n%s", code, out, errs)
	}
}
