package data

import (
	"fmt"
	"image"
	"os"
	"path/filepath"
	"testing"
)

// TestImageFolderExportRoundTrip exports the first Fashion-MNIST samples to an image folder
// of 8-bit grey PNGs (CLASS = "LABEL-x", files named by index) and checks that the folder
// loads as the same dataset: the same order, labels and shape, and batches bit-identical to
// the IDX ones under the same normalisation.
func TestImageFolderExportRoundTrip(t *testing.T) {
	if _, err := os.Stat(filepath.Join(DefaultPath, TrainImagesFile+".gz")); err != nil {
		t.Skipf("Fashion-MNIST not installed: %v", err)
	}
	cfg := DefaultConfig()
	cfg.TrainSubset, cfg.TestSubset, cfg.Cache = 600, 100, CacheNone
	train, test, err := Load(cfg)
	if err != nil {
		t.Fatal(err)
	}
	root := t.TempDir()
	for _, s := range []struct {
		split string
		d     *Dataset
	}{{SplitTrain, train}, {SplitTest, test}} {
		ss := s.d.SampleSize()
		for i := range s.d.N {
			img := &image.Gray{Pix: s.d.Images[i*ss : (i+1)*ss], Stride: s.d.W, Rect: image.Rect(0, 0, s.d.W, s.d.H)}
			writePNG(t, root, filepath.Join(s.split, fmt.Sprintf("%d-x", s.d.Labels[i]), fmt.Sprintf("%05d.png", i)), img)
		}
	}
	fcfg := folderConfig(root)
	fcfg.Mean, fcfg.Std = []float32{FashionMNISTMean}, []float32{FashionMNISTStd}
	ftrain, ftest, err := Load(fcfg)
	if err != nil {
		t.Fatal(err)
	}
	norm, err := fcfg.Norm(1)
	if err != nil {
		t.Fatal(err)
	}
	for _, p := range []struct{ idx, folder *Dataset }{{train, ftrain}, {test, ftest}} {
		if p.folder.Shape() != p.idx.Shape() || p.folder.N != p.idx.N || string(p.folder.Labels) != string(p.idx.Labels) {
			t.Fatalf("folder %+v, idx %+v", p.folder.Shape(), p.idx.Shape())
		}
		a, b := NewBatch(p.idx.N, p.idx.SampleSize()), NewBatch(p.idx.N, p.idx.SampleSize())
		if err := p.idx.FillRange(a, 0, p.idx.N, cfg.Normalize); err != nil {
			t.Fatal(err)
		}
		if err := p.folder.FillRange(b, 0, p.idx.N, norm); err != nil {
			t.Fatal(err)
		}
		for k := range a.X {
			if a.X[k] != b.X[k] {
				t.Fatalf("value %d: idx %g, folder %g", k, a.X[k], b.X[k])
			}
		}
	}
}
