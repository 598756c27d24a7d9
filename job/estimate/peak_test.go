package estimate

import (
	"image"
	"image/png"
	"os"
	"path/filepath"
	"testing"

	"github.com/qvd/qvd/configs"
	"github.com/qvd/qvd/data"
)

// TestPeakDatasetResident: the dataset term follows the data's real sizes: Fashion-MNIST's
// 60000 + 10000 images of 784 bytes (mapped: the pages a run touches; held out by val_split:
// still in the training file), and an image folder's samples, decoded per batch, count
// nothing; data that cannot be read is an error.
func TestPeakDatasetResident(t *testing.T) {
	needDataset(t)
	cfg, err := configs.Load("fashion-mlp")
	if err != nil {
		t.Fatal(err)
	}
	cfg.Train.MaxSteps = 10
	cfg.Train.MicroBatch, cfg.Train.Accum = 64, 1
	const sample, fault = 784, 64 << 10
	got, err := DatasetResident(cfg, 2)
	if want := int64(min(60000*sample, 10*64*fault) + min(10000*sample, 5000*fault)); err != nil || got != want {
		t.Errorf("mapped Fashion-MNIST: %d, %v; want %d", got, err, want)
	}
	cfg.Data.Cache = data.CacheNone
	for _, split := range []float64{0, 0.1} {
		cfg.Data.ValSplit = split
		if got, err := DatasetResident(cfg, 2); err != nil || got != 70000*sample {
			t.Errorf("val_split %g, in memory: %d, %v; want %d", split, got, err, 70000*sample)
		}
	}
	cfg.Data.TrainSubset, cfg.Data.TestSubset, cfg.Data.ValSplit = 1000, 100, 0
	if got, err := DatasetResident(cfg, 2); err != nil || got != 1100*sample {
		t.Errorf("subsets: %d, %v; want %d", got, err, 1100*sample)
	}

	root := t.TempDir()
	for _, rel := range []string{"train/a/1.png", "train/b/1.png", "test/a/1.png", "test/b/1.png"} {
		p := filepath.Join(root, rel)
		os.MkdirAll(filepath.Dir(p), 0o755)
		f, err := os.Create(p)
		if err != nil {
			t.Fatal(err)
		}
		png.Encode(f, image.NewGray(image.Rect(0, 0, 40, 30)))
		f.Close()
	}
	cfg.Data = data.DefaultConfig()
	cfg.Data.Format, cfg.Data.Path, cfg.Data.Normalize = data.FormatImageFolder, root, data.DefaultConfig().Normalize
	if got, err := DatasetResident(cfg, 1); err != nil || got != 0 {
		t.Errorf("image folder: %d, %v; want 0", got, err)
	}
	cfg.Data.Path = filepath.Join(root, "nowhere")
	if _, err := DatasetResident(cfg, 1); err == nil {
		t.Error("missing data: no error")
	}
}

func needDataset(t *testing.T) {
	t.Helper()
	if _, err := os.Stat(filepath.Join(data.DefaultPath, data.TrainImagesFile+".gz")); err != nil {
		t.Skipf("Fashion-MNIST not installed (apt-get install dataset-fashion-mnist): %v", err)
	}
}
