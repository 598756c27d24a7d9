package main

import (
	"encoding/binary"
	"encoding/json"
	"fmt"
	"math"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"

	"github.com/qvd/qvd/configs"
	"github.com/qvd/qvd/model"
)

// systemPython is the interpreter with PyTorch (not a pyenv python3 on PATH).
const systemPython = "/usr/bin/python3"

var torchScriptPath = filepath.Join("..", "..", "scripts", "torch_interop.py")

// needTorch skips the test where PyTorch is not importable by systemPython.
func needTorch(t *testing.T) {
	t.Helper()
	if testing.Short() {
		t.Skip("PyTorch interop runs a Python process per step: skipped with -short")
	}
	if out, err := exec.Command(systemPython, "-c", "import torch").CombinedOutput(); err != nil {
		t.Skipf("PyTorch interop needs %s with torch: %v %s", systemPython, err, strings.TrimSpace(string(out)))
	}
}

// torchRun runs scripts/torch_interop.py and decodes the JSON line it prints into v.
func torchRun(t *testing.T, v any, args ...string) {
	t.Helper()
	cmd := exec.Command(systemPython, append([]string{torchScriptPath}, args...)...)
	var stderr strings.Builder
	cmd.Stderr = &stderr
	out, err := cmd.Output()
	if err != nil {
		t.Fatalf("torch_interop.py %s: %v\n%s", strings.Join(args, " "), err, stderr.String())
	}
	if err := json.Unmarshal(out, v); err != nil {
		t.Fatalf("torch_interop.py %s printed %q: %v", args[0], out, err)
	}
}

type torchEval struct {
	Samples, Correct int
	Accuracy, Loss   float64
}

// torchSpec is the model description the script builds its module from.
func torchSpec(t *testing.T, cfg configs.Config, s *model.Spec) string {
	t.Helper()
	b, err := json.Marshal(map[string]any{"type": cfg.Model.Type, "input": s.Input, "classes": s.Classes,
		"hidden": cfg.Model.Hidden, "channels": cfg.Model.Channels, "kernel": cfg.Model.Kernel})
	if err != nil {
		t.Fatal(err)
	}
	return string(b)
}

func readF32(t *testing.T, path string) []float32 {
	t.Helper()
	b, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	out := make([]float32, len(b)/4)
	for i := range out {
		out[i] = math.Float32frombits(binary.LittleEndian.Uint32(b[4*i:]))
	}
	return out
}

// TestTorchInterop checks qvd's weights against PyTorch modules built to the same layout, for
// the MLP and the CNN:
//
//  1. qvd → PyTorch: after a short qvd training, the torch module loaded with the checkpoint's
//     model.safetensors gives the logits of qvd's evaluation forward pass within 1e-4 and the
//     test accuracy qvd eval reports, on the same images;
//  2. PyTorch → qvd: a module initialised by PyTorch (seeded) and saved by the script as
//     safetensors, its tensors under a "model." prefix, loads through init_from and init_map
//     into the same logits within 1e-4; and qvd train starts from exactly those weights.
func TestTorchInterop(t *testing.T) {
	needTorch(t)
	needDataset(t)
	const n = 500
	for _, config := range []string{"fashion-mlp", "fashion-cnn"} {
		t.Run(config, func(t *testing.T) {
			dir := t.TempDir()
			// 1. qvd → PyTorch.
			run, _, _ := trainShort(t, config, 40, n)
			js := filepath.Join(dir, "eval.json")
			if code, stdout, stderr := runQVD(t, "eval", "-c", config, "--checkpoint", run, "--test-subset", fmt.Sprint(n), "--json", js); code != exitOK {
				t.Fatalf("qvd eval: exit %d\n%s\n%s", code, stdout, stderr)
			}
			ev := readEvalJSON(t, js)
			qvdLogits, inf := goLogits(t, config, ev.Weights, n)
			spec := torchSpec(t, inf.cfg, inf.spec)
			var te torchEval
			tl := filepath.Join(dir, "torch-logits.f32")
			torchRun(t, &te, "eval", "--spec", spec, "--weights", ev.Weights, "--subset", fmt.Sprint(n), "--logits", tl)
			d := maxAbsDiff(qvdLogits, readF32(t, tl))
			t.Logf("qvd → torch: max |logit difference| %.3g over %d×%d logits; accuracy qvd %.4f, torch %.4f; loss qvd %.6f, torch %.6f",
				d, n, inf.spec.Classes, ev.Accuracy, te.Accuracy, ev.Loss, te.Loss)
			if d > 1e-4 {
				t.Errorf("torch logits differ from qvd's by up to %g, want <= 1e-4", d)
			}
			if te.Samples != n || te.Correct != ev.Correct {
				t.Errorf("torch: %d of %d right, qvd eval: %d of %d", te.Correct, te.Samples, ev.Correct, ev.Samples)
			}

			// 2. PyTorch → qvd.
			tw := filepath.Join(dir, "torch-init.safetensors")
			var saved struct{ Tensors map[string][]int }
			torchRun(t, &saved, "init", "--spec", spec, "--seed", "5", "--prefix", "model.", "--out", tw)
			if len(saved.Tensors) != len(inf.layout.Tensors) {
				t.Fatalf("torch saved %d tensors, qvd's model has %d", len(saved.Tensors), len(inf.layout.Tensors))
			}
			torchRun(t, &te, "eval", "--spec", spec, "--weights", tw, "--prefix", "model.", "--subset", fmt.Sprint(n), "--logits", tl)
			params := make([]float32, inf.layout.Size)
			model.Init(inf.spec, inf.layout, params, 1)
			ic := model.InitConfig{From: tw, Map: []model.Rename{{From: `^model\.`, To: ""}}, Strict: true}
			rep, err := model.LoadInit(ic, inf.layout, params)
			if err != nil || len(rep.Loaded) != len(inf.layout.Tensors) {
				t.Fatalf("init_from the torch file: %v (%+v)", err, rep)
			}
			inf.params = params
			d = maxAbsDiff(inferenceLogits(t, inf), readF32(t, tl))
			t.Logf("torch → qvd: max |logit difference| %.3g (torch accuracy %.4f)", d, te.Accuracy)
			if d > 1e-4 {
				t.Errorf("qvd's logits with the torch weights differ from torch's by up to %g, want <= 1e-4", d)
			}

			// qvd train with init_from starts from the torch weights: after one step at
			// learning rate 1e-7 its checkpoint holds them to within 1e-6.
			base, err := configs.EmbeddedYAML(config)
			if err != nil {
				t.Fatal(err)
			}
			cfgPath := filepath.Join(dir, "init.yaml")
			text := string(base) + "\ninit_from: " + tw + "\ninit_map:\n  - {from: '^model\\.', to: ''}\n"
			if err := os.WriteFile(cfgPath, []byte(text), 0o644); err != nil {
				t.Fatal(err)
			}
			out := filepath.Join(dir, "run")
			code, stdout, stderr := runQVD(t, "train", "-c", cfgPath, "--out", out, "--max-steps", "1", "--lr", "1e-7",
				"--train-subset", "640", "--test-subset", "100", "--quiet")
			if code != exitOK {
				t.Fatalf("train with init_from: exit %d\n%s\n%s", code, stdout, stderr)
			}
			if c := strings.Count(stderr, "init_from: loaded"); c != len(inf.layout.Tensors) {
				t.Errorf("%d tensors logged as loaded, want %d", c, len(inf.layout.Tensors))
			}
			got := readTensors(t, filepath.Join(out, "checkpoints", "step-00000001", "model.safetensors"))
			want := readTensors(t, tw)
			for name, w := range want {
				if d := maxAbsDiff(got[strings.TrimPrefix(name, "model.")].Data, w.Data); d > 1e-6 {
					t.Errorf("%s: the trained checkpoint differs from the torch weights by %g", name, d)
				}
			}
		})
	}
}
