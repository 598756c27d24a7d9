package main

import (
	"encoding/json"
	"fmt"
	"math"
	"os"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"testing"

	"github.com/qvd/qvd/data"
	"github.com/qvd/qvd/infer"
	"github.com/qvd/qvd/model"
)

// trainShort trains config (an embedded name) for steps steps on a subset and returns the run
// directory and the test accuracy and loss the run reported on its testSubset test samples.
func trainShort(t *testing.T, config string, steps, testSubset int, extra ...string) (string, float64, float64) {
	t.Helper()
	needDataset(t)
	out := t.TempDir()
	args := append([]string{"train", "-c", config, "--out", out, "--max-steps", fmt.Sprint(steps),
		"--train-subset", "2000", "--test-subset", fmt.Sprint(testSubset), "--quiet"}, extra...)
	code, stdout, stderr := runQVD(t, args...)
	if code != exitOK {
		t.Fatalf("qvd %v: exit %d\n%s\n%s", args, code, stdout, stderr)
	}
	m := regexp.MustCompile(`test accuracy ([0-9.]+), test loss ([0-9.]+)`).FindStringSubmatch(stdout)
	if m == nil {
		t.Fatalf("no test accuracy in the summary:\n%s", stdout)
	}
	acc, _ := strconv.ParseFloat(m[1], 64)
	loss, _ := strconv.ParseFloat(m[2], 64)
	return out, acc, loss
}

func readEvalJSON(t *testing.T, path string) infer.Report {
	t.Helper()
	b, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	var r infer.Report
	if err := json.Unmarshal(b, &r); err != nil {
		t.Fatalf("%s: %v\n%s", path, err, b)
	}
	return r
}

// TestEvalCheckpointForms: qvd eval finds the weights from a run directory, its checkpoints/
// directory, a checkpoint directory and the model.safetensors file alike, and reports the
// accuracy and loss the training run's own evaluation (the native engine) reported on the same
// images, with a confusion matrix whose rows hold each label's samples.
func TestEvalCheckpointForms(t *testing.T) {
	const n = 500
	run, acc, loss := trainShort(t, "fashion-mlp", 40, n)
	step := filepath.Join(run, "checkpoints", "step-00000040")
	for _, path := range []string{run, filepath.Join(run, "checkpoints"), step, filepath.Join(step, "model.safetensors")} {
		js := filepath.Join(t.TempDir(), "eval.json")
		code, stdout, stderr := runQVD(t, "eval", "-c", "fashion-mlp", "--checkpoint", path, "--test-subset", fmt.Sprint(n), "--json", js)
		if code != exitOK {
			t.Fatalf("eval --checkpoint %s: exit %d\n%s\n%s", path, code, stdout, stderr)
		}
		r := readEvalJSON(t, js)
		if r.Weights != filepath.Join(step, "model.safetensors") {
			t.Errorf("--checkpoint %s read %s, want the step-40 weights", path, r.Weights)
		}
		if r.Samples != n || math.Abs(r.Accuracy-acc) > 1e-4 || math.Abs(r.Loss-loss) > 1e-3 {
			t.Errorf("--checkpoint %s: %d samples, accuracy %.4f, loss %.4f; training reported %.4f, %.4f on %d", path, r.Samples, r.Accuracy, r.Loss, acc, loss, n)
		}
		if len(r.Classes) != 10 || r.Classes[9] != "Ankle boot" || len(r.Confusion) != 10 {
			t.Fatalf("classes %v, confusion %v", r.Classes, r.Confusion)
		}
		total, diag := 0, 0
		for i, row := range r.Confusion {
			for j, v := range row {
				total += v
				if i == j {
					diag += v
				}
			}
		}
		if total != n || diag != r.Correct || float64(diag)/n != r.Accuracy {
			t.Errorf("confusion matrix sums to %d with %d on the diagonal; want %d and %d", total, diag, n, r.Correct)
		}
		if !strings.Contains(stdout, "confusion matrix") || !strings.Contains(stdout, fmt.Sprintf("accuracy: %.4f", r.Accuracy)) {
			t.Errorf("stdout lacks the summary or the matrix:\n%s", stdout)
		}
	}
}

// TestEvalBadInput: a missing, empty, corrupt or mismatched checkpoint is a one-message
// error naming the problem, with a non-zero exit.
func TestEvalBadInput(t *testing.T) {
	run, _, _ := trainShort(t, "fashion-mlp", 5, 100)
	step := filepath.Join(run, "checkpoints", "step-00000005")
	corrupt := filepath.Join(t.TempDir(), "step-00000005")
	if err := os.CopyFS(corrupt, os.DirFS(step)); err != nil {
		t.Fatal(err)
	}
	mf := filepath.Join(corrupt, "model.safetensors")
	b, _ := os.ReadFile(mf)
	b[len(b)-1] ^= 0xff
	if err := os.WriteFile(mf, b, 0o644); err != nil {
		t.Fatal(err)
	}
	garbage := filepath.Join(t.TempDir(), "garbage.safetensors")
	os.WriteFile(garbage, []byte("not a safetensors file"), 0o644)
	missing := filepath.Join(t.TempDir(), "nope")
	empty := t.TempDir()
	cases := []struct {
		name string
		args []string
		code int
		want []string
	}{
		{"no checkpoint flag", []string{"eval", "-c", "fashion-mlp"}, exitUsage, []string{"--checkpoint: required"}},
		{"missing path", []string{"eval", "--checkpoint", missing}, exitFailure, []string{missing, "no such file"}},
		{"no checkpoint in dir", []string{"eval", "--checkpoint", empty}, exitFailure, []string{"no valid checkpoint", empty}},
		{"corrupt checkpoint", []string{"eval", "--checkpoint", corrupt}, exitFailure, []string{"model.safetensors", "sha256 mismatch"}},
		{"not safetensors", []string{"eval", "--checkpoint", garbage}, exitFailure, []string{garbage, "safetensors"}},
		{"wrong config", []string{"eval", "-c", "fashion-cnn", "--checkpoint", run, "--test-subset", "10"}, exitFailure,
			[]string{"tensor fc1.weight: shape mismatch", "[256 784]", "[128 3136]", "missing from the file: conv1.weight"}},
		{"argument", []string{"eval", "--checkpoint", run, "extra"}, exitUsage, []string{`unexpected argument "extra"`}},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			code, stdout, stderr := runQVD(t, c.args...)
			if code != c.code {
				t.Fatalf("exit %d, want %d\nstdout: %s\nstderr: %s", code, c.code, stdout, stderr)
			}
			for _, w := range c.want {
				if !strings.Contains(stderr, w) {
					t.Errorf("stderr does not contain %q:\n%s", w, stderr)
				}
			}
		})
	}
}

// goLogits runs qvd's inference path (config, weights, normalised test images, model.Forward)
// and returns the logits of the first n test samples with the loaded model.
func goLogits(t *testing.T, config, weights string, n int) ([]float32, *infer.Model) {
	t.Helper()
	m, err := infer.Load(infer.Options{Config: config, Checkpoint: weights, TestSubset: n, Warn: func(s string) { t.Log(s) }})
	if err != nil {
		t.Fatal(err)
	}
	return inferenceLogits(t, m), m
}

// inferenceLogits is the logits of m's whole test split under its parameters.
func inferenceLogits(t *testing.T, m *infer.Model) []float32 {
	t.Helper()
	ds, classes := m.Test, m.Spec.Classes
	b := data.NewBatch(ds.N, ds.SampleSize())
	if err := ds.FillRange(b, 0, ds.N, m.Norm); err != nil {
		t.Fatal(err)
	}
	logits := make([]float32, ds.N*classes)
	if err := model.Forward(logits, m.Spec, m.Layout, m.Params, b.X, ds.N); err != nil {
		t.Fatal(err)
	}
	return logits
}
