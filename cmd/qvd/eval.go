package main

import (
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"strings"

	"github.com/qvd/qvd/checkpoint"
	"github.com/qvd/qvd/configs"
	"github.com/qvd/qvd/data"
	"github.com/qvd/qvd/model"
)

// weightsFile is the model file inside a checkpoint directory (trainer writes it).
const weightsFile = "model.safetensors"

// fashionMNISTClasses are Fashion-MNIST's label names, by label (Xiao et al. 2017, table 1).
var fashionMNISTClasses = []string{"T-shirt/top", "Trouser", "Pullover", "Dress", "Coat", "Sandal", "Shirt", "Sneaker", "Bag", "Ankle boot"}

// inference is a model with trained weights, for qvd eval and qvd predict.
type inference struct {
	cfg     configs.Config
	spec    *model.Spec
	layout  *model.Layout
	params  []float32
	weights string        // the safetensors file the weights came from
	test    *data.Dataset // the test split (qvd eval; nil for qvd predict)
	norm    data.Normalize
	names   []string // class names, by label
}

// inferenceFlags are the flags qvd eval and qvd predict share.
type inferenceFlags struct {
	config, checkpoint, dataPath string
}

func (f *inferenceFlags) register(fs *flag.FlagSet) {
	fs.StringVar(&f.config, "c", "", "config: a YAML file, or the name of an embedded config ("+fmt.Sprint(configs.Embedded())+"); default: the config the checkpoint was trained with (its meta.json). Its model section must describe the checkpoint's model")
	fs.StringVar(&f.config, "config", "", "same as -c")
	fs.StringVar(&f.checkpoint, "checkpoint", "", "the weights: a run directory (its newest valid checkpoint), a checkpoint directory, or a model.safetensors file (which needs -c)")
	fs.StringVar(&f.dataPath, "data", "", "dataset directory (data.path)")
}

// trainedWith is what a checkpoint's meta.json says of the run that wrote it (trainer.Meta).
type trainedWith struct {
	Config     json.RawMessage `json:"config"`
	Input      []int           `json:"input"`
	Classes    int             `json:"classes"`
	ClassNames []string        `json:"class_names"`
}

// loaded is what --checkpoint and -c resolve to, before the model is built.
type loaded struct {
	cfg     configs.Config
	source  string           // where cfg came from, for messages
	weights string           // the safetensors file
	file    *checkpoint.File // its parsed contents
	meta    *trainedWith     // nil for a bare safetensors file
}

// resolve finds the weights and the config: -c where given, else the checkpoint's own
// (meta.json's snapshot of the run's config); a bare safetensors file has none, so needs
// -c. --data and testSubset > 0 (data.test_subset) override the config's.
func (f *inferenceFlags) resolve(testSubset int, warn func(string)) (*loaded, error) {
	if f.checkpoint == "" {
		return nil, fmt.Errorf("%w: --checkpoint: required (a run directory, a checkpoint directory or a model.safetensors file)", configs.ErrInvalid)
	}
	weights, ckpt, err := resolveWeights(f.checkpoint, warn)
	if err != nil {
		return nil, err
	}
	file, err := checkpoint.ReadSafetensorsFile(weights)
	if err != nil {
		return nil, err
	}
	l := &loaded{weights: weights, file: file, source: f.config}
	if ckpt != nil {
		l.meta = &trainedWith{}
		if err := ckpt.Meta(l.meta); err != nil {
			return nil, fmt.Errorf("--checkpoint %s: %w", ckpt.Path(), err)
		}
	}
	switch {
	case f.config != "":
		if l.cfg, err = configs.Load(f.config); err != nil {
			return nil, err
		}
	case l.meta == nil:
		return nil, fmt.Errorf("%w: --checkpoint %s is a bare weights file, which does not record the config it was trained with: give that config with -c (or pass the checkpoint directory, whose meta.json holds it)", configs.ErrInvalid, weights)
	default:
		l.source = filepath.Join(ckpt.Path(), "meta.json")
		if l.cfg, err = snapshotConfig(l.meta.Config, l.source); err != nil {
			return nil, err
		}
	}
	if f.dataPath != "" {
		l.cfg.Data.Path = f.dataPath
	}
	if testSubset > 0 {
		l.cfg.Data.TestSubset = testSubset
	}
	l.cfg.Resolve()
	if err := l.cfg.Model.Validate(); err != nil {
		return nil, fmt.Errorf("%w: %s: model.%w", configs.ErrInvalid, l.source, err)
	}
	if err := l.cfg.Data.Validate(); err != nil {
		return nil, fmt.Errorf("%w: %s: data.%w", configs.ErrInvalid, l.source, err)
	}
	return l, nil
}

// snapshotConfig decodes the resolved config a checkpoint's meta.json holds over the
// defaults.
func snapshotConfig(raw json.RawMessage, source string) (configs.Config, error) {
	cfg := configs.Default()
	if len(raw) == 0 || string(raw) == "null" {
		return cfg, fmt.Errorf("%w: %s records no config: give the one the run was trained with, -c", configs.ErrInvalid, source)
	}
	if err := json.Unmarshal(raw, &cfg); err != nil {
		return cfg, fmt.Errorf("%w: %s: the config it records: %v (give the one the run was trained with, -c)", configs.ErrInvalid, source, err)
	}
	return cfg, nil
}

// build builds the config's model for samples of shape and reads the weights into it.
func (l *loaded) build(shape data.Shape) (*inference, error) {
	spec, err := model.NewSpec(l.cfg.Model, shape.Input(), shape.Classes)
	if err != nil {
		return nil, err
	}
	norm, err := l.cfg.Data.Norm(shape.C)
	if err != nil {
		return nil, err
	}
	layout := model.NewLayout(spec)
	params := make([]float32, layout.Size)
	if _, err := model.InitFromFile(l.file, nil, true, layout, params); err != nil {
		return nil, fmt.Errorf("loading the weights into the %s model of config %s (the one they were trained with?): %s: %w", spec, l.source, l.weights, err)
	}
	return &inference{cfg: l.cfg, spec: spec, layout: layout, params: params, weights: l.weights, norm: norm}, nil
}

// load builds the config's model, reads the weights into it and opens the test split it is
// evaluated on. testSubset > 0 keeps only that many test samples (data.test_subset).
func (f *inferenceFlags) load(testSubset int, warn func(string)) (*inference, error) {
	l, err := f.resolve(testSubset, warn)
	if err != nil {
		return nil, err
	}
	_, test, err := data.Load(l.cfg.Data)
	if err != nil {
		return nil, err
	}
	inf, err := l.build(test.Shape())
	if err != nil {
		return nil, err
	}
	inf.test = test
	inf.names = classNames(l.cfg, test.Classes, test.ClassNames)
	return inf, nil
}

// classNames are the data's label names (an image folder's class folders, Fashion-MNIST's
// names), or the labels' numbers.
func classNames(cfg configs.Config, classes int, named []string) []string {
	if len(named) == classes {
		return named
	}
	if cfg.Data.Dataset == data.FashionMNIST && classes == len(fashionMNISTClasses) {
		return fashionMNISTClasses
	}
	names := make([]string, classes)
	for i := range names {
		names[i] = fmt.Sprint(i)
	}
	return names
}

// resolveWeights finds the safetensors file behind --checkpoint: the file itself, a
// checkpoint directory's model.safetensors (verified against its meta.json), or the newest
// checkpoint that verifies in a run directory's checkpoints/ or a checkpoint directory's
// parent, as --resume auto picks it; warn reports each checkpoint skipped. The checkpoint is
// nil for a bare file.
func resolveWeights(path string, warn func(string)) (string, *checkpoint.Checkpoint, error) {
	st, err := os.Stat(path)
	if err != nil {
		return "", nil, fmt.Errorf("--checkpoint: %w", err)
	}
	if !st.IsDir() {
		return path, nil, nil
	}
	var c *checkpoint.Checkpoint
	if _, err := os.Stat(filepath.Join(path, "meta.json")); err == nil {
		if c, err = checkpoint.Open(path); err != nil {
			return "", nil, fmt.Errorf("--checkpoint: %w", err)
		}
	} else {
		dir := path
		if st, err := os.Stat(filepath.Join(path, "checkpoints")); err == nil && st.IsDir() {
			dir = filepath.Join(path, "checkpoints")
		}
		var skipped []error
		c, skipped, err = checkpoint.Resolve(checkpoint.ResumeAuto, dir)
		for _, s := range skipped {
			warn(fmt.Sprintf("skipping a checkpoint that failed verification: %v", s))
		}
		if err != nil {
			return "", nil, fmt.Errorf("--checkpoint %s: %w", path, err)
		}
	}
	file, err := c.FilePath(weightsFile)
	if err != nil {
		return "", nil, fmt.Errorf("--checkpoint: %w", err)
	}
	return file, c, nil
}

// evalBatch is how many samples one Forward call takes: its activations stay in the caches.
const evalBatch = 256

// evaluate runs the model over the whole test split.
func (inf *inference) evaluate() (*model.Confusion, error) {
	ds, classes := inf.test, inf.spec.Classes
	b := data.NewBatch(evalBatch, ds.SampleSize())
	logits := make([]float32, evalBatch*classes)
	conf := model.NewConfusion(classes)
	for start := 0; start < ds.N; start += evalBatch {
		n := min(evalBatch, ds.N-start)
		if err := ds.FillRange(b, start, n, inf.norm); err != nil {
			return nil, err
		}
		if err := model.Forward(logits, inf.spec, inf.layout, inf.params, b.X, n); err != nil {
			return nil, err
		}
		if err := conf.Add(logits, b.Y, n); err != nil {
			return nil, err
		}
	}
	return conf, nil
}

// evalReport is what qvd eval --json writes.
type evalReport struct {
	Weights  string   `json:"weights"`
	Model    string   `json:"model"`
	Samples  int      `json:"samples"`
	Correct  int      `json:"correct"`
	Accuracy float64  `json:"accuracy"`
	Loss     float64  `json:"loss"`
	Classes  []string `json:"classes"`
	// Confusion[true][predicted] counts the samples of each label by prediction.
	Confusion [][]int `json:"confusion"`
}

func cmdEval(args []string, stdout, stderr io.Writer) int {
	fs := newFlagSet("eval")
	var f inferenceFlags
	f.register(fs)
	jsonPath := fs.String("json", "", "also write accuracy, loss and the confusion matrix as JSON to this file")
	subset := fs.Int("test-subset", 0, "evaluate on the first N test samples only (data.test_subset)")
	if code, ok := parseFlags(fs, args, stdout, stderr); !ok {
		return code
	}
	if fs.NArg() > 0 {
		return usageError(fs, stderr, "unexpected argument %q (flags only)", fs.Arg(0))
	}
	if *subset < 0 {
		return usageError(fs, stderr, "--test-subset must be >= 0, got %d", *subset)
	}
	warn := func(s string) { fmt.Fprintf(stderr, "warning: %s\n", s) }
	inf, err := f.load(*subset, warn)
	if err != nil {
		return inferenceFailed("eval", stderr, err)
	}
	conf, err := inf.evaluate()
	if err != nil {
		return inferenceFailed("eval", stderr, err)
	}
	rep := evalReport{Weights: inf.weights, Model: inf.spec.String(), Samples: conf.N(), Correct: conf.Correct(),
		Accuracy: conf.Accuracy(), Loss: conf.Loss(), Classes: inf.names}
	for r := 0; r < conf.Classes; r++ {
		rep.Confusion = append(rep.Confusion, conf.Counts[r*conf.Classes:(r+1)*conf.Classes])
	}
	printEval(stdout, rep)
	if *jsonPath != "" {
		b, err := json.MarshalIndent(rep, "", "  ")
		if err == nil {
			err = os.WriteFile(*jsonPath, append(b, '\n'), 0o644)
		}
		if err != nil {
			fmt.Fprintf(stderr, "qvd eval: writing --json: %v\n", err)
			return exitFailure
		}
	}
	return exitOK
}

// printEval prints the summary and the confusion matrix, rows the true labels.
func printEval(w io.Writer, r evalReport) {
	fmt.Fprintf(w, "weights:  %s\nmodel:    %s\n", r.Weights, r.Model)
	fmt.Fprintf(w, "accuracy: %.4f (%d/%d)\nloss:     %.4f\n\n", r.Accuracy, r.Correct, r.Samples, r.Loss)
	width := 5
	for _, n := range r.Classes {
		width = max(width, len(n)+4)
	}
	fmt.Fprintf(w, "confusion matrix (rows: true class, columns: predicted)\n%*s", width, "")
	for c := range r.Classes {
		fmt.Fprintf(w, " %6d", c)
	}
	fmt.Fprintln(w)
	for c, row := range r.Confusion {
		fmt.Fprintf(w, "%-*s", width, fmt.Sprintf("%d %s", c, r.Classes[c]))
		for _, v := range row {
			fmt.Fprintf(w, " %6d", v)
		}
		fmt.Fprintln(w)
	}
}

// inferenceFailed prints err for qvd CMD and returns its exit code: exitUsage for a bad
// flag or config, exitFailure otherwise (a missing or corrupt checkpoint, a mismatch).
func inferenceFailed(cmd string, stderr io.Writer, err error) int {
	msg := strings.ReplaceAll(err.Error(), "\n", "\n  ")
	fmt.Fprintf(stderr, "qvd %s: %s\n", cmd, msg)
	if errors.Is(err, configs.ErrInvalid) {
		return exitUsage
	}
	return exitFailure
}
