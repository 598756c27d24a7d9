package data

import (
	"fmt"
	"math"
)

// Dataset names accepted in Config.Dataset. Both use the same IDX file names and format.
const (
	FashionMNIST = "fashion-mnist"
	MNIST        = "mnist"
)

// DefaultPath is where Debian's dataset-fashion-mnist package installs the files.
const DefaultPath = "/usr/share/datasets/fashion-mnist"

// Fashion-MNIST training-set pixel statistics, on the [0, 1] scale (pixel/255) over all 60000
// training images: the usual values used to standardise its inputs. The test in this package
// recomputes them from the installed files. MNIST's are 0.1307 and 0.3081; set them in
// normalize when training on MNIST.
const (
	FashionMNISTMean = 0.2860
	FashionMNISTStd  = 0.3530
)

// Formats accepted in Config.Format.
const (
	// FormatIDX is the four MNIST-style IDX files of Fashion-MNIST or MNIST.
	FormatIDX = "idx"
	// FormatImageFolder is PNG or JPEG files in train/CLASS/, test/CLASS/ (see folder.go).
	FormatImageFolder = "image-folder"
	// FormatSafetensors is train.safetensors and test.safetensors holding the tensors
	// images and labels (see safetensors.go).
	FormatSafetensors = "safetensors"
)

// What Config.OnError does with a sample whose file cannot be read or decoded.
const (
	OnErrorSkip = "skip" // fill its row with the next good sample and count it
	OnErrorFail = "fail" // the batch, and so the run, fails with an error naming the file
)

// MaxChannels bounds the channels of a sample: enough for RGB(A) and small enough that the
// per-channel lookup tables of a fill stay on the stack.
const MaxChannels = 4

// MaxClasses bounds the classes of a dataset: labels are held as one byte per sample.
const MaxClasses = 256

// Config selects and preprocesses the dataset. YAML under `data:`.
type Config struct {
	// Format is how the dataset is stored: idx (the default), image-folder or safetensors.
	Format string `yaml:"format" json:"format"`
	// Dataset is "fashion-mnist" or "mnist" with format idx; with the other formats it only
	// names the dataset in logs.
	Dataset string `yaml:"dataset" json:"dataset"`
	// Path is, for idx, the directory holding the four IDX files, gzip-compressed
	// (train-images-idx3-ubyte.gz, ...) or not (train-images-idx3-ubyte, ...); for
	// image-folder, the directory holding train/ and test/; for safetensors, the directory
	// holding train.safetensors and test.safetensors.
	Path string `yaml:"path" json:"path"`
	// Normalize standardises pixels when a batch is filled, the same for every channel.
	// It is format idx's setting; Mean and Std, where set, replace it.
	Normalize Normalize `yaml:"normalize" json:"normalize"`
	// Mean and Std standardise channel c of a sample on the [0, 1] scale as
	// (x - Mean[c]) / Std[c]: one value for every channel, or one per channel. Unset, format
	// idx uses Normalize and the other formats leave the [0, 1] values as they are (mean 0,
	// std 1), since their statistics are unknown.
	Mean []float32 `yaml:"mean" json:"mean,omitempty"`
	Std  []float32 `yaml:"std" json:"std,omitempty"`
	// Channels is 1 (grey) or 3 (RGB): what image-folder converts every image to (0 = as
	// the first training image is).
	Channels int `yaml:"channels" json:"channels,omitempty"`
	// ImageSize is [H, W]: what image-folder resizes every image to, bilinearly (empty =
	// the first training image's size).
	ImageSize []int `yaml:"image_size" json:"image_size,omitempty"`
	// Augment randomly crops and flips training samples (off by default).
	Augment AugmentConfig `yaml:"augment" json:"augment"`
	// OnError is skip (the default) or fail: what a training or test sample whose file
	// cannot be decoded does (image-folder). Skipped files are counted and reported.
	OnError string `yaml:"on_error" json:"on_error,omitempty"`
	// TrainSubset uses only the first N training samples (0 = all), for quick runs and tests.
	TrainSubset int `yaml:"train_subset" json:"train_subset"`
	// TestSubset uses only the first N test samples (0 = all).
	TestSubset int `yaml:"test_subset" json:"test_subset"`
	// ValSplit holds this fraction of the training samples (after train_subset) out as a
	// validation split, drawn by the run's seed (Options.Seed): never trained on, evaluated
	// after every epoch, while the test split is then evaluated once, at the end (0 = no
	// split). With format image-folder a val/CLASS/ folder next to train/ is the validation
	// split instead, and val_split must stay 0.
	ValSplit float64 `yaml:"val_split" json:"val_split,omitempty"`
	// Cache is where gzip-compressed image files are decompressed once, so that every run and
	// every rank on the host maps the same copy instead of holding its own in memory; ""
	// (the default) is the user's cache directory ($XDG_CACHE_HOME/qvd/datasets), "none" reads
	// the images into memory. Raw IDX files are mapped where they are. Subsets are read.
	Cache string `yaml:"cache" json:"cache"`
	// Prefetch is how many training micro-batches a goroutine normalises ahead of the step,
	// so filling overlaps compute (0 = fill each one in the step; at most MaxPrefetch). The
	// batches are the same either way; the queue costs Prefetch+1 micro-batches of float32.
	Prefetch int `yaml:"prefetch" json:"prefetch"`
}

// Normalize maps a pixel p in [0, 255] to ((p/255) - Mean) / Std, and a float32 value x of
// a safetensors dataset to (x - Mean) / Std.
type Normalize struct {
	Mean float32 `yaml:"mean" json:"mean"`
	Std  float32 `yaml:"std" json:"std"`
	// PerChannel, when set (by Config.Norm from data.mean and data.std), gives channel c
	// the mapping PerChannel[c] in place of Mean and Std. It has no YAML key of its own.
	PerChannel []Normalize `yaml:"-" json:"per_channel,omitempty"`
}

// channel is the mapping of channel c.
func (n Normalize) channel(c int) Normalize {
	if c < len(n.PerChannel) {
		return n.PerChannel[c]
	}
	return Normalize{Mean: n.Mean, Std: n.Std}
}

// DefaultPrefetch is Config.Prefetch's default: two micro-batches ahead hide the filling of
// one behind the compute of another even when a step's time jitters.
const DefaultPrefetch = 2

// DefaultConfig is Fashion-MNIST from the Debian package's directory, standardised with the
// training-set statistics, all samples, prefetching DefaultPrefetch micro-batches.
func DefaultConfig() Config {
	return Config{
		Format:    FormatIDX,
		OnError:   OnErrorSkip,
		Dataset:   FashionMNIST,
		Path:      DefaultPath,
		Normalize: Normalize{Mean: FashionMNISTMean, Std: FashionMNISTStd},
		Prefetch:  DefaultPrefetch,
	}
}

// Validate checks the fields; errors name the field by its YAML name.
func (c Config) Validate() error {
	switch c.Format {
	case FormatIDX:
		switch c.Dataset {
		case FashionMNIST:
		case MNIST:
			// The default path holds Fashion-MNIST under the same file names, so leaving it
			// unchanged would silently train on the wrong dataset.
			if c.Path == DefaultPath {
				return fmt.Errorf("path: %s holds Fashion-MNIST; set path to the directory with the MNIST files for dataset %s", DefaultPath, MNIST)
			}
		default:
			return fmt.Errorf("dataset: unknown dataset %q for format %s (want %s or %s)", c.Dataset, FormatIDX, FashionMNIST, MNIST)
		}
		if c.Path == "" {
			return fmt.Errorf("path: must name the directory with the IDX files, e.g. %s", DefaultPath)
		}
	case FormatImageFolder, FormatSafetensors:
		if c.Path == "" || c.Path == DefaultPath {
			return fmt.Errorf("path: format %s needs the directory holding %s, got %q", c.Format, formatLayout(c.Format), c.Path)
		}
		if d := DefaultConfig().Normalize; c.Normalize.Mean != d.Mean || c.Normalize.Std != d.Std {
			return fmt.Errorf("normalize: applies to format %s only; set mean and std (per channel) for format %s", FormatIDX, c.Format)
		}
	default:
		return fmt.Errorf("format: unknown format %q (want %s, %s or %s)", c.Format, FormatIDX, FormatImageFolder, FormatSafetensors)
	}
	if err := c.Normalize.Validate(); err != nil {
		return fmt.Errorf("normalize.%w", err)
	}
	if err := c.validateImage(); err != nil {
		return err
	}
	if err := c.Augment.Validate(); err != nil {
		return fmt.Errorf("augment.%w", err)
	}
	switch c.OnError {
	case OnErrorSkip, OnErrorFail:
	default:
		return fmt.Errorf("on_error: must be %s or %s, got %q", OnErrorSkip, OnErrorFail, c.OnError)
	}
	if c.TrainSubset < 0 {
		return fmt.Errorf("train_subset: must be >= 0 (0 = all samples), got %d", c.TrainSubset)
	}
	if c.TestSubset < 0 {
		return fmt.Errorf("test_subset: must be >= 0 (0 = all samples), got %d", c.TestSubset)
	}
	if !(c.ValSplit >= 0 && c.ValSplit < 1) {
		return fmt.Errorf("val_split: must be in [0, 1) (the fraction of training samples held out; 0 = none), got %g", c.ValSplit)
	}
	if c.Prefetch < 0 || c.Prefetch > MaxPrefetch {
		return fmt.Errorf("prefetch: must be in [0, %d] (0 = fill in the step), got %d", MaxPrefetch, c.Prefetch)
	}
	return nil
}

// validateImage checks mean, std, channels and image_size.
func (c Config) validateImage() error {
	for _, f := range []struct {
		name string
		v    []float32
	}{{"mean", c.Mean}, {"std", c.Std}} {
		if len(f.v) > MaxChannels {
			return fmt.Errorf("%s: one value, or one per channel (at most %d), got %d", f.name, MaxChannels, len(f.v))
		}
		for i, x := range f.v {
			if math.IsNaN(float64(x)) || math.IsInf(float64(x), 0) || (f.name == "std" && !(x > 0)) {
				return fmt.Errorf("%s[%d]: must be finite%s, got %g", f.name, i, map[bool]string{true: " and > 0"}[f.name == "std"], x)
			}
		}
	}
	if len(c.Mean) > 1 && len(c.Std) > 1 && len(c.Mean) != len(c.Std) {
		return fmt.Errorf("mean, std: %d and %d values; give one for every channel, or one per channel in both", len(c.Mean), len(c.Std))
	}
	if c.Channels != 0 && c.Channels != 1 && c.Channels != 3 {
		return fmt.Errorf("channels: must be 1 (grey), 3 (RGB) or 0 (as the first image), got %d", c.Channels)
	}
	if len(c.ImageSize) != 0 && (len(c.ImageSize) != 2 || c.ImageSize[0] < 1 || c.ImageSize[1] < 1 || c.ImageSize[0] > MaxIDXSide || c.ImageSize[1] > MaxIDXSide) {
		return fmt.Errorf("image_size: must be [H, W] with sides in [1, %d], or empty for the first image's size, got %v", MaxIDXSide, c.ImageSize)
	}
	if c.Format != FormatImageFolder && (c.Channels != 0 || len(c.ImageSize) != 0) {
		return fmt.Errorf("channels, image_size: only used by format %s (got format %s)", FormatImageFolder, c.Format)
	}
	return nil
}

// Norm is the normalisation to fill batches of a dataset with `channels` channels with:
// Mean and Std where set (a missing one is 0 or 1), else Normalize for format idx, else
// mean 0 and std 1. A count of values that is neither 1 nor channels is an error naming the
// field.
func (c Config) Norm(channels int) (Normalize, error) {
	if len(c.Mean) == 0 && len(c.Std) == 0 {
		if c.Format == FormatIDX || c.Format == "" {
			return c.Normalize, nil
		}
		return Normalize{Mean: 0, Std: 1}, nil
	}
	if channels < 1 || channels > MaxChannels {
		return Normalize{}, fmt.Errorf("data: samples have %d channels, want 1 to %d", channels, MaxChannels)
	}
	per := make([]Normalize, channels)
	for ch := range per {
		per[ch] = Normalize{Mean: 0, Std: 1}
	}
	for _, f := range []struct {
		name string
		v    []float32
		set  func(n *Normalize, x float32)
	}{
		{"mean", c.Mean, func(n *Normalize, x float32) { n.Mean = x }},
		{"std", c.Std, func(n *Normalize, x float32) { n.Std = x }},
	} {
		switch len(f.v) {
		case 0:
		case 1:
			for ch := range per {
				f.set(&per[ch], f.v[0])
			}
		case channels:
			for ch := range per {
				f.set(&per[ch], f.v[ch])
			}
		default:
			return Normalize{}, fmt.Errorf("data.%s: %d values for samples of %d channels; give one, or one per channel", f.name, len(f.v), channels)
		}
	}
	n := per[0]
	if channels > 1 {
		n.PerChannel = per
	}
	return n, nil
}

// formatLayout says what a format's directory holds, for messages.
func formatLayout(format string) string {
	switch format {
	case FormatImageFolder:
		return "train/CLASS/*.png|jpg and test/CLASS/..."
	case FormatSafetensors:
		return "train.safetensors and test.safetensors"
	}
	return "the four IDX files"
}

// Validate checks that the mapping is finite; errors name the field by its YAML name.
func (n Normalize) Validate() error {
	for c, p := range n.PerChannel {
		if len(p.PerChannel) > 0 {
			return fmt.Errorf("channels[%d]: nested per-channel normalisation", c)
		}
		if err := p.Validate(); err != nil {
			return fmt.Errorf("channel %d: %w", c, err)
		}
	}
	if !(n.Std > 0) || math.IsInf(float64(n.Std), 0) {
		return fmt.Errorf("std: must be finite and > 0, got %g", n.Std)
	}
	if math.IsNaN(float64(n.Mean)) || math.IsInf(float64(n.Mean), 0) {
		return fmt.Errorf("mean: must be finite, got %g", n.Mean)
	}
	return nil
}
