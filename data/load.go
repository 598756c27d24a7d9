package data

import (
	"bufio"
	"compress/gzip"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"path/filepath"
	"slices"
	"sync"
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

// Dataset is one split. It is read-only after Load, but for its count of skipped files.
type Dataset struct {
	Name       string // Config.Dataset it was loaded as
	N, C, H, W int    // samples, channels, rows, columns
	Classes    int    // number of label classes
	// ClassNames are the classes in label order where the data names them (image-folder:
	// the class folders); nil otherwise.
	ClassNames []string
	// Images holds N*C*H*W pixels, planar per sample, sample after sample (idx, safetensors
	// U8); nil when samples are read from their files as batches need them (image-folder)
	// or held as float32 (safetensors F32).
	Images []uint8
	// Mapped is the file Images is a read-only mapping of ("" when they were read into
	// memory): the IDX file, or its decompressed copy in the cache (see mapped.go).
	Mapped string
	Labels []uint8 // N labels, each < Classes

	floats []float32 // safetensors F32 images, N*C*H*W on the [0, 1] scale
	src    source    // reads samples that are not in memory (image-folder)
	// rows, when set, maps sample i to its row rows[i] of the storage (Images, floats, src)
	// shared with the split it was drawn from (a validation split and the training samples
	// left after it); stored is then that storage's sample count. nil: sample i is row i.
	rows   []int32
	stored int
	aug    AugmentConfig // the training split's augmentation (FillAugmented)
	skips  *skipLog      // files skipped, shared by the splits of one Load
	fail   bool          // data.on_error: fail
}

// source reads samples that are not held in memory. Implementations are safe for concurrent
// use, since fills of different batches may run at once.
type source interface {
	// read writes sample i's C*H*W bytes, planar, into dst.
	read(i int, dst []uint8) error
	// name is sample i's file, for messages.
	name(i int) string
}

// SampleSize is the number of values in one sample: C*H*W.
func (d *Dataset) SampleSize() int { return d.C * d.H * d.W }

// Shape is what the model needs to know of the data: the sample shape and the class count.
type Shape struct {
	C, H, W int
	Classes int
}

// Input is the sample shape as [C, H, W].
func (s Shape) Input() []int { return []int{s.C, s.H, s.W} }

// Shape is the dataset's sample shape and class count.
func (d *Dataset) Shape() Shape { return Shape{C: d.C, H: d.H, W: d.W, Classes: d.Classes} }

// Options are the caller's hooks into loading; the zero value has none.
type Options struct {
	// Warn, when set, is called once for every file skipped under data.on_error: skip,
	// with the error naming it, from whichever goroutine fills the batch.
	Warn func(err error)
	// Seed draws the samples data.val_split holds out (the run's seed): every rank, and
	// every resume, of a run holds out the same ones.
	Seed uint64
}

// Splits are a dataset's splits. Val is nil when the data has no validation split.
type Splits struct {
	Train, Val, Test *Dataset
}

// row is where sample i is stored.
func (d *Dataset) row(i int) int {
	if d.rows == nil {
		return i
	}
	return int(d.rows[i])
}

// storedN is the number of samples in the storage (Images, floats, src) d reads.
func (d *Dataset) storedN() int {
	if d.rows == nil {
		return d.N
	}
	return d.stored
}

// Load reads the training and test splits named by cfg (Open without options). A missing
// file is an error naming it, with a hint on how to install the dataset, for which
// errors.Is(err, fs.ErrNotExist) holds; bad content is an error wrapping ErrCorrupt.
func Load(cfg Config) (train, test *Dataset, err error) {
	return Open(cfg, Options{})
}

// Open opens the training and test splits named by cfg, in cfg.Format. Format idx reads or
// maps the IDX files; image-folder lists the files and decodes each sample when a batch needs
// it; safetensors maps (U8) or reads (F32) the images. The training split carries
// cfg.Augment for FillAugmented.
//
// With a validation split (data.val_split, or an image folder's val/), train is what is
// left of the training samples after it; OpenSplits returns the validation split too.
func Open(cfg Config, opts Options) (train, test *Dataset, err error) {
	s, err := OpenSplits(cfg, opts)
	if err != nil {
		return nil, nil, err
	}
	return s.Train, s.Test, nil
}

// OpenSplits is Open returning the validation split as well: the training samples that
// data.val_split holds out (drawn by opts.Seed, see HoldOut), or an image folder's val/
// folder. Without either, Val is nil and Train and Test are Open's.
func OpenSplits(cfg Config, opts Options) (Splits, error) {
	if err := cfg.Validate(); err != nil {
		return Splits{}, fmt.Errorf("data: invalid config: %w", err)
	}
	skips := &skipLog{warn: opts.Warn}
	var s Splits
	var err error
	switch cfg.Format {
	case FormatImageFolder:
		s, err = loadFolder(cfg, skips)
	case FormatSafetensors:
		s.Train, s.Test, err = loadSafetensors(cfg)
	default:
		s.Train, s.Test, err = loadIDX(cfg)
	}
	if err != nil {
		return Splits{}, err
	}
	train := s.Train
	for _, o := range []struct {
		name string
		d    *Dataset
	}{{"test", s.Test}, {"validation", s.Val}} {
		if d := o.d; d != nil && (d.C != train.C || d.H != train.H || d.W != train.W) {
			return Splits{}, fmt.Errorf("data: %w: %s samples are %dx%dx%d but training samples are %dx%dx%d", ErrCorrupt, o.name, d.C, d.H, d.W, train.C, train.H, train.W)
		}
	}
	if _, err := cfg.Norm(train.C); err != nil {
		return Splits{}, err
	}
	for _, d := range []*Dataset{s.Train, s.Test, s.Val} {
		if d != nil {
			d.skips, d.fail = skips, cfg.OnError == OnErrorFail
		}
	}
	if cfg.ValSplit > 0 {
		if s.Train, s.Val, err = HoldOut(train, cfg.ValSplit, opts.Seed); err != nil {
			return Splits{}, fmt.Errorf("data: val_split: %w", err)
		}
	}
	s.Train.aug = cfg.Augment
	return s, nil
}

// Describe returns the sample shape and class count of the data cfg names, reading as
// little as it can (headers and file lists), for callers that size a model without training
// it.
func Describe(cfg Config) (Shape, error) {
	if err := cfg.Validate(); err != nil {
		return Shape{}, fmt.Errorf("data: invalid config: %w", err)
	}
	switch cfg.Format {
	case FormatImageFolder:
		classes, err := folderClasses(cfg.Path)
		if err != nil {
			return Shape{}, fmt.Errorf("data: %w", err)
		}
		files, err := listFolder(cfg.Path, SplitTrain, classes)
		if err != nil {
			return Shape{}, fmt.Errorf("data: train: %w", err)
		}
		c, h, w, err := folderShape(cfg, files[0].path)
		if err != nil {
			return Shape{}, fmt.Errorf("data: %w", err)
		}
		return Shape{C: c, H: h, W: w, Classes: len(classes)}, nil
	case FormatSafetensors:
		return describeSafetensors(cfg)
	}
	path := locate(cfg.Path, TrainImagesFile)
	f, err := os.Open(path)
	if err != nil {
		return Shape{}, fmt.Errorf("data: train images: %w", withHint(err, cfg))
	}
	defer f.Close()
	var src io.Reader = bufio.NewReader(f)
	if head, err := src.(*bufio.Reader).Peek(2); err == nil && head[0] == gzipMagic[0] && head[1] == gzipMagic[1] {
		zr, err := gzip.NewReader(src)
		if err != nil {
			return Shape{}, fmt.Errorf("data: train images: read %s: %w", path, classify(err, "gzip header"))
		}
		defer zr.Close()
		src = zr
	}
	dims, _, _, err := readHeader(src, MagicIDXImages)
	if err != nil {
		return Shape{}, fmt.Errorf("data: train images: read %s: %w", path, err)
	}
	return Shape{C: 1, H: dims[1], W: dims[2], Classes: NumClasses}, nil
}

// Skipped is the number of distinct files skipped so far under data.on_error: skip, over
// both splits of the Load that made d.
func (d *Dataset) Skipped() int {
	if d.skips == nil {
		return 0
	}
	return d.skips.count()
}

// skipLog records the samples that could not be read, so each is reported once and not read
// again. Guarded by mu: the prefetcher and the evaluation fill concurrently.
type skipLog struct {
	warn func(error)
	mu   sync.Mutex
	bad  map[skipKey]bool
}

type skipKey struct {
	d *Dataset
	i int
}

func (l *skipLog) known(d *Dataset, i int) bool {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.bad[skipKey{d, i}]
}

func (l *skipLog) add(d *Dataset, i int, err error) {
	l.mu.Lock()
	first := !l.bad[skipKey{d, i}]
	if l.bad == nil {
		l.bad = make(map[skipKey]bool)
	}
	l.bad[skipKey{d, i}] = true
	l.mu.Unlock()
	if first && l.warn != nil {
		l.warn(err)
	}
}

func (l *skipLog) count() int {
	l.mu.Lock()
	defer l.mu.Unlock()
	return len(l.bad)
}

// loadIDX reads format idx's two splits.
func loadIDX(cfg Config) (train, test *Dataset, err error) {
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
