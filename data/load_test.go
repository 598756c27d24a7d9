package data

import (
	"errors"
	"io/fs"
	"math"
	"os"
	"path/filepath"
	"runtime"
	"strings"
	"testing"
)

// synthSplit writes an images/labels pair into dir: n samples of h x w, pixels from seq, label
// i%10, gzip-compressed or raw.
func synthSplit(t testing.TB, dir, imagesFile, labelsFile string, n, h, w int, gz bool) {
	t.Helper()
	labels := make([]byte, n)
	for i := range labels {
		labels[i] = byte(i % NumClasses)
	}
	img := idxBytes(MagicIDXImages, []uint32{uint32(n), uint32(h), uint32(w)}, seq(n*h*w))
	lab := idxBytes(MagicIDXLabels, []uint32{uint32(n)}, labels)
	if gz {
		img, lab = gzipBytes(t, img), gzipBytes(t, lab)
		imagesFile, labelsFile = imagesFile+".gz", labelsFile+".gz"
	}
	writeFile(t, filepath.Join(dir, imagesFile), img)
	writeFile(t, filepath.Join(dir, labelsFile), lab)
}

// synthDir holds a compressed training split (50 samples) and a raw test split (20), 6x5.
func synthDir(t testing.TB) string {
	dir := t.TempDir()
	synthSplit(t, dir, TrainImagesFile, TrainLabelsFile, 50, 6, 5, true)
	synthSplit(t, dir, TestImagesFile, TestLabelsFile, 20, 6, 5, false)
	return dir
}

func synthConfig(dir string) Config {
	cfg := DefaultConfig()
	cfg.Path = dir
	cfg.Cache = filepath.Join(dir, "cache")
	return cfg
}

func TestLoadSynthetic(t *testing.T) {
	train, test, err := Load(synthConfig(synthDir(t)))
	if err != nil {
		t.Fatal(err)
	}
	for _, c := range []struct {
		d *Dataset
		n int
	}{{train, 50}, {test, 20}} {
		d := c.d
		if d.Name != FashionMNIST || d.N != c.n || d.C != 1 || d.H != 6 || d.W != 5 || d.Classes != 10 || d.SampleSize() != 30 {
			t.Fatalf("got %+v", *d)
		}
		if string(d.Images) != string(seq(c.n*30)) || len(d.Labels) != c.n || d.Labels[13] != 3 {
			t.Fatalf("content differs")
		}
	}
}

func TestLoadSubsets(t *testing.T) {
	cfg := synthConfig(synthDir(t))
	cfg.TrainSubset, cfg.TestSubset = 7, 20
	train, test, err := Load(cfg)
	if err != nil {
		t.Fatal(err)
	}
	if train.N != 7 || len(train.Images) != 7*30 || len(train.Labels) != 7 {
		t.Fatalf("train subset: N=%d len=%d", train.N, len(train.Images))
	}
	if string(train.Images) != string(seq(50 * 30)[:7*30]) {
		t.Fatal("train subset is not the first samples")
	}
	if test.N != 20 {
		t.Fatalf("test subset equal to the size: N=%d", test.N)
	}
	cfg.TrainSubset = 51
	if _, _, err := Load(cfg); err == nil || !strings.Contains(err.Error(), "train_subset: 51 exceeds the 50 samples") {
		t.Fatalf("oversized subset: %v", err)
	}
}

// TestLoadSubsetMemory: a subset costs its own size, not the file's — Load never holds the
// whole decoded payload on the way to the subset, gzip or raw.
func TestLoadSubsetMemory(t *testing.T) {
	const n, side, subset = 8000, 28, 100
	full := uint64(n * side * side)
	for _, gz := range []bool{true, false} {
		dir := t.TempDir()
		synthSplit(t, dir, TrainImagesFile, TrainLabelsFile, n, side, side, gz)
		synthSplit(t, dir, TestImagesFile, TestLabelsFile, 10, side, side, gz)
		cfg := synthConfig(dir)
		cfg.TrainSubset = subset
		var before, after runtime.MemStats
		runtime.ReadMemStats(&before)
		train, _, err := Load(cfg)
		runtime.ReadMemStats(&after)
		if err != nil {
			t.Fatal(err)
		}
		if train.N != subset || string(train.Images) != string(seq(n * side * side)[:subset*side*side]) {
			t.Fatalf("gzip %v: subset N=%d, or not the first samples", gz, train.N)
		}
		alloc := after.TotalAlloc - before.TotalAlloc
		t.Logf("gzip %v: Load of %d of %d samples allocated %d bytes in all (the file holds %d pixels)", gz, subset, n, alloc, full)
		if alloc > full/4 {
			t.Errorf("gzip %v: Load allocated %d bytes for a subset of %d bytes; the file's payload is %d", gz, alloc, subset*side*side, full)
		}
	}
	// A corrupt tail past the subset is still caught: the whole file is decoded and checked.
	dir := t.TempDir()
	synthSplit(t, dir, TrainImagesFile, TrainLabelsFile, 50, 6, 5, true)
	synthSplit(t, dir, TestImagesFile, TestLabelsFile, 20, 6, 5, false)
	path := filepath.Join(dir, TrainImagesFile+".gz")
	b, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	b[len(b)-6] ^= 0xff // inside the CRC-32 trailer
	writeFile(t, path, b)
	cfg := synthConfig(dir)
	cfg.TrainSubset = 5
	if _, _, err := Load(cfg); !errors.Is(err, ErrCorrupt) {
		t.Fatalf("corrupt gzip trailer with a subset: %v", err)
	}
}

func TestLoadMissingFileMessage(t *testing.T) {
	dir := t.TempDir()
	_, _, err := Load(synthConfig(dir))
	want := "data: train images: open " + filepath.Join(dir, "train-images-idx3-ubyte.gz") +
		": no such file or directory (install with: apt-get install dataset-fashion-mnist, or set data.path)"
	if err == nil || err.Error() != want {
		t.Fatalf("error:\n %v\nwant:\n %s", err, want)
	}
	if !errors.Is(err, fs.ErrNotExist) || errors.Is(err, ErrCorrupt) {
		t.Fatalf("error %v: want fs.ErrNotExist and not ErrCorrupt", err)
	}

	// A missing labels file is named as such, and MNIST gets its own hint.
	synthSplit(t, dir, TrainImagesFile, TrainLabelsFile, 3, 2, 2, false)
	os.Remove(filepath.Join(dir, TrainLabelsFile))
	cfg := synthConfig(dir)
	cfg.Dataset = MNIST
	_, _, err = Load(cfg)
	if err == nil || !strings.HasPrefix(err.Error(), "data: train labels: open ") || !strings.Contains(err.Error(), "MNIST IDX files") {
		t.Fatalf("missing labels: %v", err)
	}
}

func TestLoadCorrupt(t *testing.T) {
	for _, c := range []struct {
		name  string
		setup func(dir string)
		want  string
	}{
		{"count mismatch", func(dir string) {
			writeFile(t, filepath.Join(dir, TestLabelsFile), idxBytes(MagicIDXLabels, []uint32{19}, make([]byte, 19)))
		}, "holds 20 images but"},
		{"label out of range", func(dir string) {
			labels := make([]byte, 20)
			labels[17] = 10
			writeFile(t, filepath.Join(dir, TestLabelsFile), idxBytes(MagicIDXLabels, []uint32{20}, labels))
		}, "label 10 at index 17 is outside [0, 10)"},
		{"image size mismatch", func(dir string) {
			synthSplit(t, dir, TestImagesFile, TestLabelsFile, 20, 5, 6, false)
		}, "test images are 5x6 but training images are 6x5"},
		{"empty split", func(dir string) {
			synthSplit(t, dir, TestImagesFile, TestLabelsFile, 0, 6, 5, false)
		}, "holds no images"},
		{"truncated gzip", func(dir string) {
			p := filepath.Join(dir, TrainImagesFile+".gz")
			b, _ := os.ReadFile(p)
			writeFile(t, p, b[:len(b)-20])
		}, "data: train images: read " + TrainImagesFile + ".gz"},
	} {
		dir := synthDir(t)
		c.setup(dir)
		_, _, err := Load(synthConfig(dir))
		if !errors.Is(err, ErrCorrupt) || !strings.Contains(strings.ReplaceAll(err.Error(), dir+"/", ""), c.want) {
			t.Errorf("%s: error %v, want ErrCorrupt containing %q", c.name, err, c.want)
		}
	}
}

func TestConfigValidate(t *testing.T) {
	if err := DefaultConfig().Validate(); err != nil {
		t.Fatalf("default config: %v", err)
	}
	for _, c := range []struct {
		edit func(*Config)
		want string
	}{
		{func(c *Config) { c.Dataset = "cifar10" }, "dataset: unknown dataset \"cifar10\""},
		{func(c *Config) { c.Path = "" }, "path: "},
		{func(c *Config) { c.Dataset = MNIST }, "path: " + DefaultPath + " holds Fashion-MNIST"},
		{func(c *Config) { c.Normalize.Std = 0 }, "normalize.std: must be finite and > 0, got 0"},
		{func(c *Config) { c.Normalize.Std = -1 }, "normalize.std: "},
		{func(c *Config) { c.Normalize.Std = float32(math.NaN()) }, "normalize.std: "},
		{func(c *Config) { c.Normalize.Std = float32(math.Inf(1)) }, "normalize.std: "},
		{func(c *Config) { c.Normalize.Mean = float32(math.NaN()) }, "normalize.mean: "},
		{func(c *Config) { c.TrainSubset = -1 }, "train_subset: must be >= 0"},
		{func(c *Config) { c.TestSubset = -2 }, "test_subset: must be >= 0"},
		{func(c *Config) { c.Prefetch = -1 }, "prefetch: must be in [0, 64]"},
		{func(c *Config) { c.Prefetch = MaxPrefetch + 1 }, "prefetch: must be in [0, 64]"},
	} {
		cfg := DefaultConfig()
		c.edit(&cfg)
		err := cfg.Validate()
		if err == nil || !strings.HasPrefix(err.Error(), c.want) {
			t.Errorf("Validate() = %v, want prefix %q", err, c.want)
		}
		if _, _, lerr := Load(cfg); lerr == nil || !strings.Contains(lerr.Error(), "data: invalid config: ") {
			t.Errorf("Load with bad config: %v", lerr)
		}
	}
	cfg := DefaultConfig()
	cfg.Dataset, cfg.Path = MNIST, "/somewhere/mnist"
	if err := cfg.Validate(); err != nil {
		t.Errorf("mnist with its own path: %v", err)
	}
}

// TestLoadRealDataset checks the installed Fashion-MNIST: sizes, classes, the balanced label
// histogram, and the normalisation statistics DefaultConfig documents.
func TestLoadRealDataset(t *testing.T) {
	for _, f := range []string{TrainImagesFile, TrainLabelsFile, TestImagesFile, TestLabelsFile} {
		if _, err := os.Stat(filepath.Join(DefaultPath, f+".gz")); err != nil {
			t.Skipf("Fashion-MNIST not installed (%v); install with: apt-get install dataset-fashion-mnist", err)
		}
	}
	train, test, err := Load(DefaultConfig())
	if err != nil {
		t.Fatal(err)
	}
	for _, c := range []struct {
		d        *Dataset
		n, class int
	}{{train, 60000, 6000}, {test, 10000, 1000}} {
		d := c.d
		if d.N != c.n || d.C != 1 || d.H != 28 || d.W != 28 || d.Classes != 10 || len(d.Images) != c.n*784 {
			t.Fatalf("got N=%d C=%d H=%d W=%d classes=%d", d.N, d.C, d.H, d.W, d.Classes)
		}
		var hist [NumClasses]int
		for _, l := range d.Labels {
			hist[l]++
		}
		for k, v := range hist {
			if v != c.class {
				t.Errorf("%d samples: class %d has %d, want %d", c.n, k, v, c.class)
			}
		}
	}
	var sum, sumSq float64
	for _, p := range train.Images {
		v := float64(p) / 255
		sum += v
		sumSq += v * v
	}
	n := float64(len(train.Images))
	mean := sum / n
	std := math.Sqrt(sumSq/n - mean*mean)
	t.Logf("training-set pixel mean %.5f std %.5f", mean, std)
	if math.Abs(mean-FashionMNISTMean) > 5e-5 || math.Abs(std-FashionMNISTStd) > 5e-5 {
		t.Errorf("training-set mean %.5f std %.5f, documented %.4f %.4f", mean, std, FashionMNISTMean, FashionMNISTStd)
	}
}
