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
	"go.yaml.in/yaml/v3"
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

// torchSpec is the model description the script builds its module from: the model config's
// fields (the ViT's as set, the script filling in the same defaults; the layers list as its
// JSON), the data's sample shape and class count.
func torchSpec(t *testing.T, cfg configs.Config, s *model.Spec) string {
	t.Helper()
	m := cfg.Model
	b, err := json.Marshal(map[string]any{"type": m.Type, "input": s.Input, "classes": s.Classes,
		"hidden": m.Hidden, "channels": m.Channels, "kernel": m.Kernel,
		"patch": m.Patch, "dim": m.Dim, "depth": m.Depth, "heads": m.Heads, "mlp_ratio": m.MLPRatio, "dropout": m.Dropout,
		"layers": m.Layers})
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

// torchViTYAML is a ViT small enough for a test: 7×7 patches (16 tokens and the class
// token), 32 features, 2 blocks of 2 heads, an MLP of 64, dropout on (identity in evaluation).
const torchViTYAML = `run: {name: torch-vit, seed: 7}
model: {type: vit, patch: 7, dim: 32, depth: 2, heads: 2, mlp_ratio: 2, dropout: 0.1}
optimizer: {type: adamw, lr: 0.002}
scheduler: {type: constant}
`

// torchLayersYAML is a residual CNN written as a layers list: batch normalisation (its running
// statistics are saved and evaluation uses them), a residual branch, global mean pooling.
const torchLayersYAML = `run: {name: torch-layers, seed: 7}
model:
  layers:
    - {type: conv2d, name: stem, out: 8, kernel: 3}
    - {type: batchnorm2d, name: stem_bn}
    - {type: relu}
    - {type: maxpool2}
    - type: residual
      layers:
        - {type: conv2d, out: 8, kernel: 3}
        - {type: batchnorm2d}
        - {type: relu}
        - {type: conv2d, out: 8, kernel: 3}
    - {type: relu}
    - {type: mean_pool}
    - {type: dense, name: head}
optimizer: {type: adamw, lr: 0.01}
`

// TestTorchInterop checks qvd's weights against PyTorch modules built to the same layout, for
// the MLP, the CNN, a ViT and a layers-list model (batch norm, a residual branch, mean
// pooling):
//
//  1. qvd → PyTorch: after a short qvd training, the torch module loaded with the checkpoint's
//     model.safetensors gives the logits of qvd's evaluation forward pass within 1e-4 and the
//     test accuracy qvd eval reports, on the same images, and the accuracy and loss the
//     training run's own evaluation (the native engine) reported;
//  2. PyTorch → qvd: a module initialised by PyTorch (seeded) and saved by the script as
//     safetensors, its tensors under a "model." prefix, loads through init_from and init_map
//     into the same logits within 1e-4;
//  3. one SGD step of qvd train from those weights (init_from) on 64 training images gives
//     the weights (and batch-norm running statistics) of the same step in PyTorch within 1e-5:
//     training starts from exactly the torch weights and qvd's gradients are autograd's.
func TestTorchInterop(t *testing.T) {
	needTorch(t)
	needDataset(t)
	const n = 500
	cases := []struct {
		name, config string // config: an embedded config's name, or a YAML text
		steps        int
	}{
		{"fashion-mlp", "fashion-mlp", 40},
		{"fashion-cnn", "fashion-cnn", 40},
		{"vit", torchViTYAML, 30},
		{"layers", torchLayersYAML, 30},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			config, base := tc.config, []byte(tc.config)
			if strings.Contains(tc.config, "\n") {
				config = filepath.Join(t.TempDir(), tc.name+".yaml")
				if err := os.WriteFile(config, base, 0o644); err != nil {
					t.Fatal(err)
				}
			} else {
				var err error
				if base, err = configs.EmbeddedYAML(config); err != nil {
					t.Fatal(err)
				}
			}
			dir := t.TempDir()
			// 1. qvd → PyTorch.
			run, engAcc, engLoss := trainShort(t, config, tc.steps, n)
			js := filepath.Join(dir, "eval.json")
			if code, stdout, stderr := runQVD(t, "eval", "-c", config, "--checkpoint", run, "--test-subset", fmt.Sprint(n), "--json", js); code != exitOK {
				t.Fatalf("qvd eval: exit %d\n%s\n%s", code, stdout, stderr)
			}
			ev := readEvalJSON(t, js)
			qvdLogits, inf := goLogits(t, config, ev.Weights, n)
			spec := torchSpec(t, inf.Config, inf.Spec)
			var te torchEval
			tl := filepath.Join(dir, "torch-logits.f32")
			torchRun(t, &te, "eval", "--spec", spec, "--weights", ev.Weights, "--subset", fmt.Sprint(n), "--logits", tl)
			d := maxAbsDiff(qvdLogits, readF32(t, tl))
			t.Logf("qvd → torch: max |logit difference| %.3g over %d×%d logits; accuracy qvd %.4f, torch %.4f; loss qvd %.6f, torch %.6f",
				d, n, inf.Spec.Classes, ev.Accuracy, te.Accuracy, ev.Loss, te.Loss)
			if d > 1e-4 {
				t.Errorf("torch logits differ from qvd's by up to %g, want <= 1e-4", d)
			}
			if te.Samples != n || te.Correct != ev.Correct {
				t.Errorf("torch: %d of %d right, qvd eval: %d of %d", te.Correct, te.Samples, ev.Correct, ev.Samples)
			}
			// The training run's own evaluation (the native engine's forward pass, the same
			// weights and images; printed to 4 decimals) agrees too.
			if math.Abs(engAcc-te.Accuracy) > 1e-9 || math.Abs(engLoss-te.Loss) > 1e-4 {
				t.Errorf("the training run's evaluation reported accuracy %.4f, loss %.4f; torch: %.4f, %.6f", engAcc, engLoss, te.Accuracy, te.Loss)
			}

			// 2. PyTorch → qvd.
			tw := filepath.Join(dir, "torch-init.safetensors")
			var saved struct{ Tensors map[string][]int }
			torchRun(t, &saved, "init", "--spec", spec, "--seed", "5", "--prefix", "model.", "--out", tw)
			if len(saved.Tensors) != len(inf.Layout.Tensors) {
				t.Fatalf("torch saved %d tensors, qvd's model has %d", len(saved.Tensors), len(inf.Layout.Tensors))
			}
			torchRun(t, &te, "eval", "--spec", spec, "--weights", tw, "--prefix", "model.", "--subset", fmt.Sprint(n), "--logits", tl)
			params := make([]float32, inf.Layout.Size)
			model.Init(inf.Spec, inf.Layout, params, 1)
			ic := model.InitConfig{From: tw, Map: []model.Rename{{From: `^model\.`, To: ""}}, Strict: true}
			rep, err := model.LoadInit(ic, inf.Layout, params)
			if err != nil || len(rep.Loaded) != len(inf.Layout.Tensors) {
				t.Fatalf("init_from the torch file: %v (%+v)", err, rep)
			}
			inf.Params = params
			d = maxAbsDiff(inferenceLogits(t, inf), readF32(t, tl))
			t.Logf("torch → qvd: max |logit difference| %.3g (torch accuracy %.4f)", d, te.Accuracy)
			if d > 1e-4 {
				t.Errorf("qvd's logits with the torch weights differ from torch's by up to %g, want <= 1e-4", d)
			}

			// 3. One training step from the torch weights, in qvd and in PyTorch: qvd train with
			// init_from, plain SGD (no momentum, weight decay, clipping, warm-up or dropout) on
			// the first 64 training images as one micro-batch, gives the weights and batch-norm
			// running statistics of the same step taken with PyTorch's autograd: qvd starts from
			// exactly the torch weights, and its gradients are PyTorch's. (The step moves weights
			// by up to a few hundredths; the two differ by rounding, up to ~1e-6 where batch norm
			// cancels, as in the exactly-zero gradient of a conv bias under it.)
			const stepLR, stepN = 0.1, 64
			var doc map[string]any
			if err := yaml.Unmarshal(base, &doc); err != nil {
				t.Fatal(err)
			}
			section := func(key string) map[string]any {
				m, _ := doc[key].(map[string]any)
				if m == nil {
					m = map[string]any{}
					doc[key] = m
				}
				return m
			}
			if m := section("model"); m["type"] == model.TypeViT {
				m["dropout"] = 0 // its masks are qvd's own
			}
			doc["optimizer"] = map[string]any{"type": "sgd", "lr": stepLR, "momentum": 0, "weight_decay": 0}
			doc["scheduler"] = map[string]any{"type": "constant"}
			tr := section("train")
			tr["max_grad_norm"], tr["micro_batch"], tr["accum"], tr["precision"] = 0, stepN, 1, "fp32"
			doc["init_from"] = tw
			doc["init_map"] = []any{map[string]any{"from": `^model\.`, "to": ""}}
			text, err := yaml.Marshal(doc)
			if err != nil {
				t.Fatal(err)
			}
			cfgPath := filepath.Join(dir, "step.yaml")
			if err := os.WriteFile(cfgPath, text, 0o644); err != nil {
				t.Fatal(err)
			}
			out := filepath.Join(dir, "run")
			code, stdout, stderr := runQVD(t, "train", "-c", cfgPath, "--out", out, "--max-steps", "1",
				"--train-subset", fmt.Sprint(stepN), "--test-subset", "100", "--quiet")
			if code != exitOK {
				t.Fatalf("train with init_from: exit %d\n%s\n%s\n%s", code, text, stdout, stderr)
			}
			if c := strings.Count(stderr, "init_from: loaded"); c != len(inf.Layout.Tensors) {
				t.Errorf("%d tensors logged as loaded, want %d", c, len(inf.Layout.Tensors))
			}
			stepCfg := inf.Config
			stepCfg.Model.Dropout = 0
			ts := filepath.Join(dir, "torch-step.safetensors")
			var stepped struct{ Loss float64 }
			torchRun(t, &stepped, "step", "--spec", torchSpec(t, stepCfg, inf.Spec), "--weights", tw, "--prefix", "model.",
				"--subset", fmt.Sprint(stepN), "--lr", fmt.Sprint(stepLR), "--out", ts)
			got := readTensors(t, filepath.Join(out, "checkpoints", "step-00000001", "model.safetensors"))
			start, want := readTensors(t, tw), readTensors(t, ts)
			worst, moved := 0.0, 0.0
			for name, w := range want {
				g, ok := got[strings.TrimPrefix(name, "model.")]
				if !ok {
					t.Errorf("%s: not in qvd's checkpoint", name)
					continue
				}
				d := maxAbsDiff(g.Data, w.Data)
				worst, moved = math.Max(worst, d), math.Max(moved, maxAbsDiff(start[name].Data, w.Data))
				if d > 1e-5 {
					t.Errorf("%s: after one SGD step (lr %g) qvd's checkpoint differs from torch's by %g (the step moved it by %g)",
						name, stepLR, d, maxAbsDiff(start[name].Data, w.Data))
				}
			}
			t.Logf("one SGD step: max |qvd - torch| %.3g over the weights (the step moved them by up to %.3g; torch loss %.6f)", worst, moved, stepped.Loss)
		})
	}
}
