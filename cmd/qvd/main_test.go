package main

import (
	"bytes"
	"context"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/qvd/qvd/data"
	"github.com/qvd/qvd/internal/metrics"
)

func runQVD(t *testing.T, args ...string) (int, string, string) {
	t.Helper()
	var out, errb bytes.Buffer
	code := run(context.Background(), args, &out, &errb)
	return code, out.String(), errb.String()
}

func needDataset(t *testing.T) {
	t.Helper()
	if _, err := os.Stat(filepath.Join(data.DefaultPath, data.TrainImagesFile+".gz")); err != nil {
		t.Skipf("Fashion-MNIST not installed (apt-get install dataset-fashion-mnist): %v", err)
	}
}

// TestTrainShortRealData is the CI integration run: a few hundred steps of the shipped MLP
// config on a subset of the real Fashion-MNIST must reach a useful accuracy, write metrics,
// a checkpoint that resumes, and a plot.
func TestTrainShortRealData(t *testing.T) {
	needDataset(t)
	out := t.TempDir()
	code, stdout, stderr := runQVD(t, "train", "-c", "../../configs/fashion-mlp.yaml", "--out", out,
		"--epochs", "3", "--train-subset", "8000", "--test-subset", "2000", "--quiet")
	if code != exitOK {
		t.Fatalf("exit %d\nstdout:\n%s\nstderr:\n%s", code, stdout, stderr)
	}
	recs, err := metrics.ReadFile(filepath.Join(out, "metrics.jsonl"))
	if err != nil {
		t.Fatal(err)
	}
	var train, acc = 0, 0.0
	for _, r := range recs {
		switch r.Kind {
		case metrics.KindTrain:
			train++
			if r.LR <= 0 || r.SamplesPerSec <= 0 || r.GradNorm <= 0 || r.RSSBytes == 0 {
				t.Fatalf("incomplete train record %+v", r)
			}
		case metrics.KindEval:
			acc = r.Accuracy
		}
	}
	if train != 3*125 {
		t.Fatalf("%d train records, want %d", train, 3*125)
	}
	if acc < 0.78 {
		t.Fatalf("test accuracy %.4f after 375 steps on 8000 samples, want >= 0.78", acc)
	}
	if !strings.Contains(stdout, "test accuracy") {
		t.Fatalf("no summary in stdout:\n%s", stdout)
	}

	// Resuming a finished run continues with more epochs from the final checkpoint.
	code, stdout, stderr = runQVD(t, "train", "-c", "../../configs/fashion-mlp.yaml", "--out", out,
		"--epochs", "4", "--train-subset", "8000", "--test-subset", "2000", "--quiet", "--resume", "auto")
	if code != exitOK || !strings.Contains(stderr, "resumed") {
		t.Fatalf("resume: exit %d\n%s\n%s", code, stdout, stderr)
	}
	if !strings.Contains(stdout, "done: 500 steps") {
		t.Fatalf("resumed run should end at step 500:\n%s", stdout)
	}

	png := filepath.Join(out, "curves.png")
	if code, _, stderr := runQVD(t, "plot", out, "-o", png); code != exitOK {
		t.Fatalf("plot: %s", stderr)
	}
	if st, err := os.Stat(png); err != nil || st.Size() < 1000 {
		t.Fatalf("plot output: %v", err)
	}
}

func TestTrainBadInputs(t *testing.T) {
	dir := t.TempDir()
	bad := filepath.Join(dir, "bad.yaml")
	os.WriteFile(bad, []byte("train:\n  micro_batch: 0\n  acum: 2\n"), 0o644)
	cases := []struct {
		args []string
		code int
		want string
	}{
		{[]string{"train", "-c", bad}, exitUsage, "train.acum (line 3): unknown key"},
		{[]string{"train", "--micro-batch", "-3", "--out", dir}, exitUsage, "train.micro_batch: must be in"},
		{[]string{"train", "--precision", "fp8", "--out", dir}, exitUsage, "train.precision"},
		{[]string{"train", "-c", filepath.Join(dir, "nope.yaml")}, exitUsage, "nope.yaml"},
		{[]string{"train", "--bogus"}, exitUsage, "flag provided but not defined: -bogus"},
		{[]string{"train", "--out", dir, "--data", filepath.Join(dir, "nodata"), "--quiet"}, exitFailure, filepath.Join(dir, "nodata", data.TrainImagesFile+".gz")},
		{[]string{"frobnicate"}, exitUsage, "unknown command"},
	}
	for _, c := range cases {
		code, stdout, stderr := runQVD(t, c.args...)
		if code != c.code || !strings.Contains(stdout+stderr, c.want) {
			t.Errorf("qvd %v: exit %d, want %d with %q in the output\nstdout: %s\nstderr: %s", c.args, code, c.code, c.want, stdout, stderr)
		}
	}
}

// TestResumeCorruptCheckpoint: an explicitly named corrupt checkpoint is refused naming the
// file; --resume auto falls back to the previous valid one.
func TestResumeCorruptCheckpoint(t *testing.T) {
	needDataset(t)
	out := t.TempDir()
	args := []string{"train", "--out", out, "--quiet", "--train-subset", "640", "--test-subset", "500", "--epochs", "1"}
	if code, _, stderr := runQVD(t, append(args, "--max-steps", "4")...); code != exitOK {
		t.Fatal(stderr)
	}
	if code, _, stderr := runQVD(t, append(args, "--max-steps", "8", "--resume", "auto")...); code != exitOK {
		t.Fatal(stderr)
	}
	newest := filepath.Join(out, "checkpoints", "step-00000008")
	model := filepath.Join(newest, "model.safetensors")
	st, err := os.Stat(model)
	if err != nil {
		t.Fatal(err)
	}
	os.Truncate(model, st.Size()-7)

	code, _, stderr := runQVD(t, append(args, "--max-steps", "9", "--resume", newest)...)
	if code != exitFailure || !strings.Contains(stderr, "model.safetensors") {
		t.Fatalf("corrupt checkpoint: exit %d, stderr:\n%s", code, stderr)
	}
	code, stdout, stderr := runQVD(t, append(args, "--max-steps", "9", "--resume", "auto")...)
	if code != exitOK || !strings.Contains(stderr, "skipping a checkpoint that failed verification") || !strings.Contains(stdout, "done: 9 steps") {
		t.Fatalf("auto fallback: exit %d\nstdout:\n%s\nstderr:\n%s", code, stdout, stderr)
	}
	if !strings.Contains(stderr, `"step": 4`) {
		t.Fatalf("auto should resume from step 4:\n%s", stderr)
	}
}

func TestConfigCommand(t *testing.T) {
	code, stdout, stderr := runQVD(t, "config", "-c", "fashion-cnn", "--micro-batch", "16")
	if code != exitOK || !strings.Contains(stdout, "micro_batch: 16") || !strings.Contains(stdout, "type: cnn") {
		t.Fatalf("exit %d\n%s\n%s", code, stdout, stderr)
	}
}

// TestShippedConfigsAccuracy trains the shipped configs in full and checks the accuracy the
// README promises. It takes ~20 minutes on 2 cores, so it is opt-in:
//
//	QVD_ACCURACY=1 go test -run TestShippedConfigsAccuracy -timeout 60m ./cmd/qvd/
func TestShippedConfigsAccuracy(t *testing.T) {
	if os.Getenv("QVD_ACCURACY") == "" {
		t.Skip("set QVD_ACCURACY=1 to train the shipped configs to completion (~20 min)")
	}
	needDataset(t)
	for _, c := range []struct {
		config string
		want   float64
	}{{"fashion-mlp", 0.895}, {"fashion-cnn", 0.92}} {
		t.Run(c.config, func(t *testing.T) {
			out := t.TempDir()
			code, stdout, stderr := runQVD(t, "train", "-c", c.config, "--out", out, "--quiet")
			if code != exitOK {
				t.Fatalf("exit %d\n%s\n%s", code, stdout, stderr)
			}
			recs, err := metrics.ReadFile(filepath.Join(out, "metrics.jsonl"))
			if err != nil {
				t.Fatal(err)
			}
			acc := 0.0
			for _, r := range recs {
				if r.Kind == metrics.KindEval {
					acc = r.Accuracy
				}
			}
			t.Logf("%s: final test accuracy %.4f", c.config, acc)
			if acc < c.want {
				t.Fatalf("%s: test accuracy %.4f < %.2f", c.config, acc, c.want)
			}
		})
	}
}
