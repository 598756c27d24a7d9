package main

import (
	"encoding/json"
	"fmt"
	"math"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	"github.com/qvd/qvd/configs"
	"github.com/qvd/qvd/data"
	"github.com/qvd/qvd/infer"
)

// TestEvalShippedConfigs: for every embedded config, a short run's checkpoint evaluates with
// qvd eval and no -c (the checkpoint's own config, test subset included) to the accuracy and
// loss the run reported at its end. About 4 s on 2 cores.
func TestEvalShippedConfigs(t *testing.T) {
	const n = 200
	for _, name := range configs.Embedded() {
		t.Run(name, func(t *testing.T) {
			run, acc, loss := trainShort(t, name, 8, n)
			js := filepath.Join(t.TempDir(), "eval.json")
			code, stdout, stderr := runQVD(t, "eval", "--checkpoint", run, "--json", js)
			if code != exitOK {
				t.Fatalf("eval: exit %d\n%s\n%s", code, stdout, stderr)
			}
			r := readEvalJSON(t, js)
			if r.Samples != n || math.Abs(r.Accuracy-acc) > 1e-4 || math.Abs(r.Loss-loss) > 1e-3 {
				t.Errorf("eval: %d samples, accuracy %.4f, loss %.4f; the run reported %.4f, %.4f on %d", r.Samples, r.Accuracy, r.Loss, acc, loss, n)
			}
		})
	}
}

// TestEvalConfigFromCheckpoint: without -c, qvd eval and qvd predict take the config from
// the checkpoint's meta.json (a fashion-cnn run evaluates as one, where the old default,
// fashion-mlp, would not load); a bare model.safetensors has no config and needs -c, a
// usage error saying so.
func TestEvalConfigFromCheckpoint(t *testing.T) {
	run, acc, _ := trainShort(t, "fashion-cnn", 10, 100)
	step := filepath.Join(run, "checkpoints", "step-00000010")
	js := filepath.Join(t.TempDir(), "eval.json")
	if code, stdout, stderr := runQVD(t, "eval", "--checkpoint", step, "--json", js); code != exitOK {
		t.Fatalf("eval: exit %d\n%s\n%s", code, stdout, stderr)
	}
	if r := readEvalJSON(t, js); r.Samples != 100 || math.Abs(r.Accuracy-acc) > 1e-4 || !strings.HasPrefix(r.Model, "conv") {
		t.Errorf("eval of the cnn checkpoint: model %s, %d samples, accuracy %.4f (run: %.4f on 100)", r.Model, r.Samples, r.Accuracy, acc)
	}
	bare := filepath.Join(step, "model.safetensors")
	for _, cmd := range [][]string{{"eval"}, {"predict", "x.png"}} {
		code, _, stderr := runQVD(t, append(cmd, "--checkpoint", bare)...)
		if code != exitUsage || !strings.Contains(stderr, "bare weights file") || !strings.Contains(stderr, "-c") || !strings.Contains(stderr, bare) {
			t.Errorf("%s of a bare model.safetensors without -c: exit %d, want %d\n%s", cmd[0], code, exitUsage, stderr)
		}
	}
	if code, stdout, stderr := runQVD(t, "eval", "-c", "fashion-cnn", "--checkpoint", bare, "--test-subset", "100", "--json", js); code != exitOK {
		t.Fatalf("eval -c of the bare file: exit %d\n%s\n%s", code, stdout, stderr)
	}
	if r := readEvalJSON(t, js); math.Abs(r.Accuracy-acc) > 1e-4 {
		t.Errorf("eval -c fashion-cnn of the bare file: accuracy %.4f, the run %.4f", r.Accuracy, acc)
	}
}

// TestPredictWithoutDataset: qvd predict sizes the model from the checkpoint's record, or for
// a bare file from the weights' shapes, never from the dataset: with --data pointing nowhere
// it prints exactly what it prints with the dataset, for an MLP and a CNN.
func TestPredictWithoutDataset(t *testing.T) {
	needDataset(t)
	cfg := data.DefaultConfig()
	cfg.TrainSubset, cfg.TestSubset, cfg.Cache = 1, 3, data.CacheNone
	_, test, err := data.Load(cfg)
	if err != nil {
		t.Fatal(err)
	}
	dir := t.TempDir()
	var images []string
	for i := range 3 {
		p := filepath.Join(dir, fmt.Sprintf("sample%d.png", i))
		writeImage(t, p, test.Images[i*784:(i+1)*784], 28, 28, 1, false)
		images = append(images, p)
	}
	nowhere := filepath.Join(t.TempDir(), "no-dataset-here")
	for _, name := range []string{"fashion-mlp", "fashion-cnn"} {
		t.Run(name, func(t *testing.T) {
			run, _, _ := trainShort(t, name, 5, 50)
			bare := filepath.Join(run, "checkpoints", "step-00000005", "model.safetensors")
			predict := func(args ...string) string {
				t.Helper()
				args = append(append([]string{"predict", "--json", "--top-k", "10"}, args...), images...)
				code, stdout, stderr := runQVD(t, args...)
				if code != exitOK {
					t.Fatalf("qvd %v: exit %d\n%s\n%s", args, code, stdout, stderr)
				}
				return stdout
			}
			want := predict("-c", name, "--checkpoint", run)
			for _, args := range [][]string{
				{"--checkpoint", run, "--data", nowhere},
				{"-c", name, "--checkpoint", bare, "--data", nowhere},
			} {
				if got := predict(args...); got != want {
					t.Errorf("predict %v:\n%s\nwith the dataset:\n%s", args, got, want)
				}
			}
			var p infer.Prediction
			if err := json.Unmarshal([]byte(strings.SplitN(want, "\n", 2)[0]), &p); err != nil {
				t.Fatal(err)
			}
			if len(p.Top) != 10 || !slices.Contains(infer.FashionMNISTClasses, p.Top[0].Name) {
				t.Errorf("infer.Prediction %+v: want the 10 Fashion-MNIST classes by name", p)
			}
			if _, err := os.Stat(nowhere); err == nil {
				t.Fatal("the dataset path exists")
			}
		})
	}
}

// TestPredictModelShape: the sample shape and classes come from model.input and
// model.classes, the checkpoint's record, or the weights (the classifier's outputs; a
// square grey or RGB image for an MLP's inputs, data.image_size where set; for a CNN the
// first conv's channels and the side its pooling maps onto fc1); an input the weights
// cannot size is an error asking for model.input.
func TestPredictModelShape(t *testing.T) {
	run, _, _ := trainShort(t, "fashion-cnn", 3, 50)
	step := filepath.Join(run, "checkpoints", "step-00000003")
	shape := func(t *testing.T, o infer.Options, edit func(*configs.Config)) (data.Shape, error) {
		t.Helper()
		l, err := infer.Resolve(o)
		if err != nil {
			t.Fatal(err)
		}
		if edit != nil {
			edit(&l.Config)
		}
		return l.ModelShape()
	}
	fashion := data.Shape{C: 1, H: 28, W: 28, Classes: 10}
	for _, c := range []struct {
		name string
		f    infer.Options
		edit func(*configs.Config)
		want data.Shape
	}{
		{"checkpoint record", infer.Options{Checkpoint: step}, nil, fashion},
		{"cnn weights", infer.Options{Config: "fashion-cnn", Checkpoint: filepath.Join(step, "model.safetensors")}, nil, fashion},
		{"model.input", infer.Options{Config: "fashion-cnn", Checkpoint: filepath.Join(step, "model.safetensors")},
			func(c *configs.Config) { c.Model.Input, c.Model.Classes = []int{1, 29, 30}, 10 }, data.Shape{C: 1, H: 29, W: 30, Classes: 10}},
	} {
		t.Run(c.name, func(t *testing.T) {
			got, err := shape(t, c.f, c.edit)
			if err != nil || got != c.want {
				t.Errorf("shape %+v, %v; want %+v", got, err, c.want)
			}
		})
	}
	mlp, _, _ := trainShort(t, "fashion-mlp", 3, 50)
	bare := infer.Options{Config: "fashion-mlp", Checkpoint: filepath.Join(mlp, "checkpoints", "step-00000003", "model.safetensors")}
	if got, err := shape(t, bare, nil); err != nil || got != fashion {
		t.Errorf("mlp weights: shape %+v, %v; want %+v", got, err, fashion)
	}
	if got, err := shape(t, bare, func(c *configs.Config) { c.Data.Channels = 3 }); err == nil || !strings.Contains(err.Error(), "model.input") {
		t.Errorf("784 inputs as RGB: shape %+v, %v; want an error asking for model.input", got, err)
	}
	if got, err := shape(t, bare, func(c *configs.Config) { c.Data.Channels, c.Data.ImageSize = 1, []int{14, 56} }); err != nil || got != (data.Shape{C: 1, H: 14, W: 56, Classes: 10}) {
		t.Errorf("data.image_size 14x56: shape %+v, %v", got, err)
	}
}
