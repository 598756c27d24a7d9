package data

import (
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
)

// TestHoldOut: the held-out samples are floor(frac × N), drawn by the seed alone, disjoint
// from what is left for training, and together they are every sample once, each split in
// the original order; batches of either split are the base's samples at those indices, by
// Fill and FillRange alike, and a split of a split maps to the base's storage.
func TestHoldOut(t *testing.T) {
	d := synthDataset()
	rest, val, err := HoldOut(d, 0.25, 7)
	if err != nil {
		t.Fatal(err)
	}
	if val.N != 3 || rest.N != 9 || len(val.Labels) != 3 || len(rest.Labels) != 9 {
		t.Fatalf("rest %d, val %d samples; want 9 and 3", rest.N, val.N)
	}
	all := append(slices.Clone(rest.rows), val.rows...)
	slices.Sort(all)
	for i, r := range all {
		if int(r) != i {
			t.Fatalf("rest %v and val %v are not a partition of 0..11", rest.rows, val.rows)
		}
	}
	if !slices.IsSorted(rest.rows) || !slices.IsSorted(val.rows) {
		t.Errorf("splits not in sample order: rest %v, val %v", rest.rows, val.rows)
	}
	_, again, _ := HoldOut(d, 0.25, 7)
	if !slices.Equal(again.rows, val.rows) {
		t.Errorf("seed 7 drew %v, then %v", val.rows, again.rows)
	}
	differs := false
	for seed := uint64(8); seed < 12; seed++ {
		_, other, _ := HoldOut(d, 0.25, seed)
		differs = differs || !slices.Equal(other.rows, val.rows)
	}
	if !differs {
		t.Errorf("seeds 8-11 all drew seed 7's validation samples %v", val.rows)
	}

	norm := Normalize{Mean: 0.5, Std: 0.25}
	for _, s := range []*Dataset{rest, val} {
		idx := slices.Clone(s.rows)
		want, got, byRange := NewBatch(s.N, 6), NewBatch(s.N, 6), NewBatch(s.N, 6)
		if err := d.Fill(want, idx, norm); err != nil {
			t.Fatal(err)
		}
		pos := make([]int32, s.N)
		for i := range pos {
			pos[i] = int32(i)
		}
		if err := s.Fill(got, pos, norm); err != nil {
			t.Fatal(err)
		}
		if err := s.FillRange(byRange, 0, s.N, norm); err != nil {
			t.Fatal(err)
		}
		for _, b := range []*Batch{got, byRange} {
			if !slices.Equal(b.X, want.X) || !slices.Equal(b.Y, want.Y) {
				t.Fatalf("split rows %v: batch differs from the base's samples", s.rows)
			}
		}
	}
	rest2, val2, err := HoldOut(rest, 0.34, 7)
	if err != nil {
		t.Fatal(err)
	}
	for _, s := range []*Dataset{rest2, val2} {
		if s.stored != d.N {
			t.Errorf("a split of a split stores %d samples, want the base's %d", s.stored, d.N)
		}
		for i, r := range s.rows {
			if !slices.Contains(rest.rows, r) || s.Labels[i] != d.Labels[r] {
				t.Fatalf("row %d (label %d) is not one of the training rows %v with the base's label", r, s.Labels[i], rest.rows)
			}
		}
	}
	for _, frac := range []float64{0, 1, 0.05, -0.5} {
		if _, _, err := HoldOut(d, frac, 7); err == nil {
			t.Errorf("HoldOut(frac %g) of 12 samples: no error", frac)
		}
	}
}

// TestOpenValSplit: data.val_split holds samples out of the training split that Open
// returns, OpenSplits returns them as Val, the test split is untouched, and without
// val_split OpenSplits is Open with no Val.
func TestOpenValSplit(t *testing.T) {
	cfg := synthConfig(synthDir(t))
	base, err := OpenSplits(cfg, Options{Seed: 3})
	if err != nil {
		t.Fatal(err)
	}
	if base.Val != nil || base.Train.N != 50 || base.Test.N != 20 {
		t.Fatalf("without val_split: train %d, val %v, test %d", base.Train.N, base.Val, base.Test.N)
	}
	cfg.ValSplit = 0.1
	s, err := OpenSplits(cfg, Options{Seed: 3})
	if err != nil {
		t.Fatal(err)
	}
	if s.Val == nil || s.Val.N != 5 || s.Train.N != 45 || s.Test.N != 20 || s.Test.rows != nil {
		t.Fatalf("val_split 0.1 of 50: train %d, val %v, test %d", s.Train.N, s.Val, s.Test.N)
	}
	train, _, err := Open(cfg, Options{Seed: 3})
	if err != nil {
		t.Fatal(err)
	}
	if !slices.Equal(train.rows, s.Train.rows) {
		t.Errorf("Open trains on %v, OpenSplits on %v", train.rows, s.Train.rows)
	}
	for _, r := range s.Val.rows {
		if slices.Contains(s.Train.rows, r) {
			t.Errorf("held-out sample %d is in the training split", r)
		}
	}
	cfg.ValSplit = 1
	if _, err := OpenSplits(cfg, Options{}); err == nil || !strings.Contains(err.Error(), "val_split") {
		t.Errorf("val_split 1: %v, want an error naming val_split", err)
	}
}

// TestImageFolderValFolder: an image folder's val/ is the validation split, with train/'s
// classes; with val_split set as well, Open fails naming both.
func TestImageFolderValFolder(t *testing.T) {
	root := grayFolder(t)
	for c, class := range []string{"ankle", "bag", "coat"} {
		writePNG(t, root, filepath.Join("val", class, "v.png"), grayImage(6, 5, uint8(70+c)))
	}
	cfg := folderConfig(root)
	s, err := OpenSplits(cfg, Options{})
	if err != nil {
		t.Fatal(err)
	}
	if s.Val == nil || s.Val.N != 3 || s.Train.N != 6 || s.Test.N != 3 || !slices.Equal(s.Val.ClassNames, s.Train.ClassNames) {
		t.Fatalf("train %d, val %+v, test %d", s.Train.N, s.Val, s.Test.N)
	}
	b := NewBatch(3, s.Val.SampleSize())
	if err := s.Val.FillRange(b, 0, 3, Normalize{Mean: 0, Std: 1}); err != nil {
		t.Fatal(err)
	}
	if want := []int32{0, 1, 2}; !slices.Equal(b.Y, want) || b.X[0] != float32(70)/255 {
		t.Errorf("val labels %v (want %v), first pixel %g", b.Y, want, b.X[0])
	}
	cfg.ValSplit = 0.5
	if _, err := OpenSplits(cfg, Options{}); err == nil || !strings.Contains(err.Error(), "val_split") || !strings.Contains(err.Error(), filepath.Join(root, "val")) {
		t.Errorf("val/ and val_split: %v", err)
	}
	if err := os.RemoveAll(filepath.Join(root, "val", "coat")); err != nil {
		t.Fatal(err)
	}
	cfg.ValSplit = 0
	if _, err := OpenSplits(cfg, Options{}); err == nil || !strings.Contains(err.Error(), "missing class folders coat") {
		t.Errorf("val/ without a class: %v", err)
	}
}
