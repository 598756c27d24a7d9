package infer

import (
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"

	"github.com/qvd/qvd/checkpoint"
	"github.com/qvd/qvd/configs"
	"github.com/qvd/qvd/data"
	"github.com/qvd/qvd/model"
)

// WeightsFile is the model file inside a checkpoint directory (trainer writes it).
const WeightsFile = "model.safetensors"

// FashionMNISTClasses are Fashion-MNIST's label names, by label (Xiao et al. 2017, table 1).
var FashionMNISTClasses = []string{"T-shirt/top", "Trouser", "Pullover", "Dress", "Coat", "Sandal", "Shirt", "Sneaker", "Bag", "Ankle boot"}

// Options say where the weights and the config are: the values of qvd eval's and qvd
// predict's flags, which the errors name.
type Options struct {
	// Config is a YAML file or an embedded config's name (-c); "" takes the checkpoint's own.
	Config string
	// Checkpoint is a run directory (its newest valid checkpoint), a checkpoint directory, or
	// a model.safetensors file, which needs Config (--checkpoint).
	Checkpoint string
	DataPath   string // overrides data.path (--data)
	TestSubset int    // > 0 keeps that many test samples (data.test_subset)
	// Warn reports each checkpoint skipped because it failed verification.
	Warn func(string)
}

// Model is a model with trained weights.
type Model struct {
	Config  configs.Config
	Spec    *model.Spec
	Layout  *model.Layout
	Params  []float32
	Weights string        // the safetensors file the weights came from
	Test    *data.Dataset // the test split (Load; nil from LoadModel)
	Norm    data.Normalize
	Names   []string // class names, by label
}

// trainedWith is what a checkpoint's meta.json says of the run that wrote it (trainer.Meta).
type trainedWith struct {
	Config     json.RawMessage `json:"config"`
	Input      []int           `json:"input"`
	Classes    int             `json:"classes"`
	ClassNames []string        `json:"class_names"`
}

// Loaded is what Options resolve to, before the model is built.
type Loaded struct {
	Config  configs.Config
	source  string           // where Config came from, for messages
	weights string           // the safetensors file
	file    *checkpoint.File // its parsed contents
	meta    *trainedWith     // nil for a bare safetensors file
}

// Resolve finds the weights and the config: o.Config where given, else the checkpoint's own
// (meta.json's snapshot of the run's config); a bare safetensors file has none, so needs
// o.Config. o.DataPath and o.TestSubset override the config's.
func Resolve(o Options) (*Loaded, error) {
	if o.Checkpoint == "" {
		return nil, fmt.Errorf("%w: --checkpoint: required (a run directory, a checkpoint directory or a model.safetensors file)", configs.ErrInvalid)
	}
	weights, ckpt, err := resolveWeights(o.Checkpoint, o.Warn)
	if err != nil {
		return nil, err
	}
	file, err := checkpoint.ReadSafetensorsFile(weights)
	if err != nil {
		return nil, err
	}
	l := &Loaded{weights: weights, file: file, source: o.Config}
	if ckpt != nil {
		l.meta = &trainedWith{}
		if err := ckpt.Meta(l.meta); err != nil {
			return nil, fmt.Errorf("--checkpoint %s: %w", ckpt.Path(), err)
		}
	}
	switch {
	case o.Config != "":
		if l.Config, err = configs.Load(o.Config); err != nil {
			return nil, err
		}
	case l.meta == nil:
		return nil, fmt.Errorf("%w: --checkpoint %s is a bare weights file, which does not record the config it was trained with: give that config with -c (or pass the checkpoint directory, whose meta.json holds it)", configs.ErrInvalid, weights)
	default:
		l.source = filepath.Join(ckpt.Path(), "meta.json")
		if l.Config, err = snapshotConfig(l.meta.Config, l.source); err != nil {
			return nil, err
		}
	}
	if o.DataPath != "" {
		l.Config.Data.Path = o.DataPath
	}
	if o.TestSubset > 0 {
		l.Config.Data.TestSubset = o.TestSubset
	}
	l.Config.Resolve()
	if err := l.Config.Model.Validate(); err != nil {
		return nil, fmt.Errorf("%w: %s: model.%w", configs.ErrInvalid, l.source, err)
	}
	if err := l.Config.Data.Validate(); err != nil {
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
func (l *Loaded) build(shape data.Shape) (*Model, error) {
	spec, err := model.NewSpec(l.Config.Model, shape.Input(), shape.Classes)
	if err != nil {
		return nil, err
	}
	norm, err := l.Config.Data.Norm(shape.C)
	if err != nil {
		return nil, err
	}
	layout := model.NewLayout(spec)
	params := make([]float32, layout.Size)
	if _, err := model.InitFromFile(l.file, nil, true, layout, params); err != nil {
		return nil, fmt.Errorf("loading the weights into the %s model of config %s (the one they were trained with?): %s: %w", spec, l.source, l.weights, err)
	}
	return &Model{Config: l.Config, Spec: spec, Layout: layout, Params: params, Weights: l.weights, Norm: norm}, nil
}

// Load builds the config's model, reads the weights into it and opens the test split it is
// evaluated on.
func Load(o Options) (*Model, error) {
	l, err := Resolve(o)
	if err != nil {
		return nil, err
	}
	_, test, err := data.Load(l.Config.Data)
	if err != nil {
		return nil, err
	}
	m, err := l.build(test.Shape())
	if err != nil {
		return nil, err
	}
	m.Test = test
	m.Names = classNames(l.Config, test.Classes, test.ClassNames)
	return m, nil
}

// LoadModel builds the config's model and reads the weights into it without opening the
// dataset (see ModelShape); o.TestSubset is not used.
func LoadModel(o Options) (*Model, error) {
	o.TestSubset = 0
	l, err := Resolve(o)
	if err != nil {
		return nil, err
	}
	shape, err := l.ModelShape()
	if err != nil {
		return nil, err
	}
	m, err := l.build(shape)
	if err != nil {
		return nil, err
	}
	var named []string
	if l.meta != nil {
		named = l.meta.ClassNames
	}
	m.Names = classNames(l.Config, shape.Classes, named)
	return m, nil
}

// classNames are the data's label names (an image folder's class folders, Fashion-MNIST's
// names), or the labels' numbers.
func classNames(cfg configs.Config, classes int, named []string) []string {
	if len(named) == classes {
		return named
	}
	if cfg.Data.Dataset == data.FashionMNIST && classes == len(FashionMNISTClasses) {
		return FashionMNISTClasses
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
			if warn != nil {
				warn(fmt.Sprintf("skipping a checkpoint that failed verification: %v", s))
			}
		}
		if err != nil {
			return "", nil, fmt.Errorf("--checkpoint %s: %w", path, err)
		}
	}
	file, err := c.FilePath(WeightsFile)
	if err != nil {
		return "", nil, fmt.Errorf("--checkpoint: %w", err)
	}
	return file, c, nil
}
