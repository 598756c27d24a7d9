package data

import (
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"slices"
)

// NumClasses is the number of label classes of both MNIST and Fashion-MNIST.
const NumClasses = 10

// The standard IDX file names. Load looks for each with a .gz suffix first, then without.
const (
	TrainImagesFile = "train-images-idx3-ubyte"
	TrainLabelsFile = "train-labels-idx1-ubyte"
	TestImagesFile  = "t10k-images-idx3-ubyte"
	TestLabelsFile  = "t10k-labels-idx1-ubyte"
)

// Dataset is one split held in memory. It is read-only after Load.
type Dataset struct {
	Name       string  // Config.Dataset it was loaded as
	N, C, H, W int     // samples, channels (1), rows, columns
	Classes    int     // number of label classes (10)
	Images     []uint8 // N*C*H*W pixels, row-major, sample after sample
	// Mapped is the file Images is a read-only mapping of ("" when they were read into
	// memory): the IDX file, or its decompressed copy in the cache (see mapped.go).
	Mapped string
	Labels []uint8 // N labels, each < Classes
}

// SampleSize is the number of values in one sample: C*H*W.
func (d *Dataset) SampleSize() int { return d.C * d.H * d.W }

// Load reads the training and test splits named by cfg. A missing file is an error naming it,
// with a hint on how to install the dataset, for which errors.Is(err, fs.ErrNotExist) holds;
// bad content is an error wrapping ErrCorrupt.
func Load(cfg Config) (train, test *Dataset, err error) {
	if err := cfg.Validate(); err != nil {
		return nil, nil, fmt.Errorf("data: invalid config: %w", err)
	}
	train, err = loadSplit(cfg, "train", TrainImagesFile, TrainLabelsFile, cfg.TrainSubset, "train_subset")
	if err != nil {
		return nil, nil, err
	}
	test, err = loadSplit(cfg, "test", TestImagesFile, TestLabelsFile, cfg.TestSubset, "test_subset")
	if err != nil {
		return nil, nil, err
	}
	if test.H != train.H || test.W != train.W {
		return nil, nil, fmt.Errorf("data: %w: test images are %dx%d but training images are %dx%d", ErrCorrupt, test.H, test.W, train.H, train.W)
	}
	return train, test, nil
}

func loadSplit(cfg Config, split, imagesFile, labelsFile string, subset int, subsetField string) (*Dataset, error) {
	// With a subset, only its images are kept: the rest of the file is decoded (to check it)
	// but never held, so a subset costs its own size and not the file's. The labels are a
	// byte per sample and are all read and checked.
	imagesPath := locate(cfg.Path, imagesFile)
	var dims []int
	var pix []byte
	var mapped string
	err := errNoMap
	if cfg.Cache != CacheNone && subset == 0 {
		dims, pix, mapped, err = mapImages(cfg, imagesPath)
	}
	if errors.Is(err, errNoMap) {
		// No mapping (a subset, data.cache: none, or no cache directory to decompress
		// into): read the pixels into memory.
		mapped = ""
		dims, pix, err = readIDXFile(imagesPath, MagicIDXImages, subset)
	}
	if err != nil {
		return nil, fmt.Errorf("data: %s images: %w", split, withHint(err, cfg))
	}
	labelsPath := locate(cfg.Path, labelsFile)
	_, labels, err := readIDXFile(labelsPath, MagicIDXLabels, 0)
	if err != nil {
		return nil, fmt.Errorf("data: %s labels: %w", split, withHint(err, cfg))
	}

	n := dims[0]
	if len(labels) != n {
		return nil, fmt.Errorf("data: %s: %w: %s holds %d images but %s holds %d labels", split, ErrCorrupt, imagesPath, n, labelsPath, len(labels))
	}
	if n == 0 {
		return nil, fmt.Errorf("data: %s: %w: %s holds no images", split, ErrCorrupt, imagesPath)
	}
	for i, l := range labels {
		if l >= NumClasses {
			return nil, fmt.Errorf("data: %s labels: read %s: %w: label %d at index %d is outside [0, %d)", split, labelsPath, ErrCorrupt, l, i, NumClasses)
		}
	}
	if subset > n {
		return nil, fmt.Errorf("data: %s: %d exceeds the %d samples in %s", subsetField, subset, n, imagesPath)
	}
	if subset > 0 && subset < n {
		labels = slices.Clone(labels[:subset]) // so the full-size labels can be freed
		n = subset
	}
	return &Dataset{
		Name: cfg.Dataset, N: n, C: 1, H: dims[1], W: dims[2], Classes: NumClasses,
		Images: pix, Labels: labels, Mapped: mapped,
	}, nil
}

// locate returns dir/name.gz, or dir/name when only the uncompressed file exists.
func locate(dir, name string) string {
	gz := filepath.Join(dir, name+".gz")
	if _, err := os.Stat(gz); errors.Is(err, fs.ErrNotExist) {
		raw := filepath.Join(dir, name)
		if _, err := os.Stat(raw); err == nil {
			return raw
		}
	}
	return gz
}

// withHint adds to a missing-file error how to get the files.
func withHint(err error, cfg Config) error {
	if !errors.Is(err, fs.ErrNotExist) {
		return err
	}
	hint := "install with: apt-get install dataset-fashion-mnist, or set data.path"
	if cfg.Dataset == MNIST {
		hint = "put the four MNIST IDX files there, or set data.path"
	}
	return fmt.Errorf("%w (%s)", err, hint)
}
