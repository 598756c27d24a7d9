package main

import (
	"bytes"
	"math"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/qvd/qvd/checkpoint"
)

// readTensors reads every tensor of a safetensors file.
func readTensors(t *testing.T, path string) map[string]checkpoint.Tensor {
	t.Helper()
	f, err := checkpoint.ReadSafetensorsFile(path)
	if err != nil {
		t.Fatal(err)
	}
	out := map[string]checkpoint.Tensor{}
	for _, n := range f.Names() {
		if out[n], err = f.Tensor(n); err != nil {
			t.Fatal(err)
		}
	}
	return out
}

func maxAbsDiff(a, b []float32) float64 {
	if len(a) != len(b) {
		return math.Inf(1)
	}
	d := 0.0
	for i := range a {
		d = math.Max(d, math.Abs(float64(a[i]-b[i])))
	}
	return d
}

// TestInitFromTrain: qvd train with init_from starts from the file's weights. A backbone saved
// under other names (backbone.fc1.weight, ...) with a head the model has no place for loads
// through init_map with init_strict false, every tensor logged; the same file is refused with
// init_strict true, listing the missing and unexpected tensors, and a model of another shape
// is refused naming the tensor and both shapes.
func TestInitFromTrain(t *testing.T) {
	runA, _, _ := trainShort(t, "fashion-mlp", 40, 100)
	a := readTensors(t, filepath.Join(runA, "checkpoints", "step-00000040", "model.safetensors"))
	var ts []checkpoint.Tensor
	for _, n := range []string{"fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"} {
		x := a[n]
		x.Name = "backbone." + n
		ts = append(ts, x)
	}
	ts = append(ts, checkpoint.Tensor{Name: "head.weight", Shape: []int{10, 128}, Data: make([]float32, 1280)})
	dir := t.TempDir()
	var buf bytes.Buffer
	if err := checkpoint.WriteSafetensors(&buf, ts, nil); err != nil {
		t.Fatal(err)
	}
	weights := filepath.Join(dir, "backbone.safetensors")
	if err := os.WriteFile(weights, buf.Bytes(), 0o644); err != nil {
		t.Fatal(err)
	}
	config := func(hidden string, strict bool) string {
		p := filepath.Join(t.TempDir(), "init.yaml")
		text := "model: {type: mlp, hidden: " + hidden + "}\ninit_from: " + weights + "\ninit_map:\n  - {from: '^backbone\\.', to: ''}\n"
		if !strict {
			text += "init_strict: false\n"
		}
		if err := os.WriteFile(p, []byte(text), 0o644); err != nil {
			t.Fatal(err)
		}
		return p
	}
	train := func(cfg string) (string, int, string) {
		out := t.TempDir()
		code, stdout, stderr := runQVD(t, "train", "-c", cfg, "--out", out, "--max-steps", "1", "--train-subset", "640", "--test-subset", "100", "--quiet", "--lr", "1e-7")
		return out, code, stdout + stderr
	}

	out, code, log := train(config("[256, 128]", false))
	if code != exitOK {
		t.Fatalf("partial load: exit %d\n%s", code, log)
	}
	for _, want := range []string{"init_from: loaded", `"tensor": "fc1.weight", "from": "backbone.fc1.weight"`, `"tensor": "fc2.bias"`,
		"init_from: missing from the file", `"tensor": "fc3.weight"`, "init_from: unexpected tensor", `"tensor": "head.weight"`} {
		if !strings.Contains(log, want) {
			t.Errorf("the log lacks %q:\n%s", want, log)
		}
	}
	if n := strings.Count(log, "init_from: loaded"); n != 4 {
		t.Errorf("%d tensors logged as loaded, want 4", n)
	}
	// One Adam step at learning rate 1e-7 moves no weight by more than about 1e-7:
	// the loaded ones stay at the file's values, the head keeps its random initialisation.
	b := readTensors(t, filepath.Join(out, "checkpoints", "step-00000001", "model.safetensors"))
	for _, n := range []string{"fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"} {
		if d := maxAbsDiff(a[n].Data, b[n].Data); d > 1e-6 {
			t.Errorf("%s differs from the file by %g after one step", n, d)
		}
	}
	if d := maxAbsDiff(a["fc3.weight"].Data, b["fc3.weight"].Data); d < 1e-3 {
		t.Errorf("fc3.weight was not in the file but equals run A's (max difference %g)", d)
	}

	_, code, log = train(config("[256, 128]", true))
	if code == exitOK || !strings.Contains(log, "missing from the file: fc3.weight, fc3.bias") || !strings.Contains(log, "not in the model: head.weight") ||
		!strings.Contains(log, "init_strict: false") {
		t.Errorf("strict load of a partial file: exit %d, want a failure listing the tensors\n%s", code, log)
	}
	_, code, log = train(config("[64, 128]", false))
	if code == exitOK || !strings.Contains(log, `tensor fc1.weight: shape mismatch: the file's "backbone.fc1.weight" is [256 784], the model's is [64 784]`) {
		t.Errorf("shape mismatch: exit %d, want a failure naming the tensor and both shapes\n%s", code, log)
	}
}
