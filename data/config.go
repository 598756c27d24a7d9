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

// Config selects and preprocesses the dataset. YAML under `data:`.
type Config struct {
	// Dataset is "fashion-mnist" or "mnist".
	Dataset string `yaml:"dataset" json:"dataset"`
	// Path is the directory holding the four IDX files, gzip-compressed
	// (train-images-idx3-ubyte.gz, ...) or not (train-images-idx3-ubyte, ...).
	Path string `yaml:"path" json:"path"`
	// Normalize standardises pixels when a batch is filled.
	Normalize Normalize `yaml:"normalize" json:"normalize"`
	// TrainSubset uses only the first N training samples (0 = all), for quick runs and tests.
	TrainSubset int `yaml:"train_subset" json:"train_subset"`
	// TestSubset uses only the first N test samples (0 = all).
	TestSubset int `yaml:"test_subset" json:"test_subset"`
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

// Normalize maps a pixel p in [0, 255] to ((p/255) - Mean) / Std.
type Normalize struct {
	Mean float32 `yaml:"mean" json:"mean"`
	Std  float32 `yaml:"std" json:"std"`
}

// DefaultPrefetch is Config.Prefetch's default: two micro-batches ahead hide the filling of
// one behind the compute of another even when a step's time jitters.
const DefaultPrefetch = 2

// DefaultConfig is Fashion-MNIST from the Debian package's directory, standardised with the
// training-set statistics, all samples, prefetching DefaultPrefetch micro-batches.
func DefaultConfig() Config {
	return Config{
		Dataset:   FashionMNIST,
		Path:      DefaultPath,
		Normalize: Normalize{Mean: FashionMNISTMean, Std: FashionMNISTStd},
		Prefetch:  DefaultPrefetch,
	}
}

// Validate checks the fields; errors name the field by its YAML name.
func (c Config) Validate() error {
	switch c.Dataset {
	case FashionMNIST:
	case MNIST:
		// The default path holds Fashion-MNIST under the same file names, so leaving it
		// unchanged would silently train on the wrong dataset.
		if c.Path == DefaultPath {
			return fmt.Errorf("path: %s holds Fashion-MNIST; set path to the directory with the MNIST files for dataset %s", DefaultPath, MNIST)
		}
	default:
		return fmt.Errorf("dataset: unknown dataset %q (want %s or %s)", c.Dataset, FashionMNIST, MNIST)
	}
	if c.Path == "" {
		return fmt.Errorf("path: must name the directory with the IDX files, e.g. %s", DefaultPath)
	}
	if err := c.Normalize.Validate(); err != nil {
		return fmt.Errorf("normalize.%w", err)
	}
	if c.TrainSubset < 0 {
		return fmt.Errorf("train_subset: must be >= 0 (0 = all samples), got %d", c.TrainSubset)
	}
	if c.TestSubset < 0 {
		return fmt.Errorf("test_subset: must be >= 0 (0 = all samples), got %d", c.TestSubset)
	}
	if c.Prefetch < 0 || c.Prefetch > MaxPrefetch {
		return fmt.Errorf("prefetch: must be in [0, %d] (0 = fill in the step), got %d", MaxPrefetch, c.Prefetch)
	}
	return nil
}

// Validate checks that the mapping is finite; errors name the field by its YAML name.
func (n Normalize) Validate() error {
	if !(n.Std > 0) || math.IsInf(float64(n.Std), 0) {
		return fmt.Errorf("std: must be finite and > 0, got %g", n.Std)
	}
	if math.IsNaN(float64(n.Mean)) || math.IsInf(float64(n.Mean), 0) {
		return fmt.Errorf("mean: must be finite, got %g", n.Mean)
	}
	return nil
}
