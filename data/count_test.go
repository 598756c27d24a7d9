package data

import (
	"path/filepath"
	"testing"
)

// TestCount: the splits' sizes and the sample's bytes come from the headers and file lists,
// with the subsets and the validation split applied, and agree with what OpenSplits loads.
func TestCount(t *testing.T) {
	dir := synthDir(t)
	folder := grayFolder(t)
	for _, c := range []struct {
		name string
		cfg  func() Config
		want Sizes
	}{
		{"idx", func() Config { return synthConfig(dir) },
			Sizes{Shape: Shape{1, 6, 5, 10}, Train: 50, Test: 20, SampleBytes: 30, Mapped: true, TestMapped: true}},
		{"idx subsets and val_split", func() Config {
			c := synthConfig(dir)
			c.TrainSubset, c.TestSubset, c.ValSplit = 40, 10, 0.25
			return c
		}, Sizes{Shape: Shape{1, 6, 5, 10}, Train: 30, Val: 10, Test: 10, SampleBytes: 30}},
		{"idx cache none", func() Config {
			c := synthConfig(dir)
			c.Cache = CacheNone
			return c
		}, Sizes{Shape: Shape{1, 6, 5, 10}, Train: 50, Test: 20, SampleBytes: 30}},
		{"image folder", func() Config { return folderConfig(folder) },
			Sizes{Shape: Shape{1, 6, 5, 3}, Train: 6, Test: 3}},
	} {
		t.Run(c.name, func(t *testing.T) {
			got, err := Count(c.cfg())
			if err != nil {
				t.Fatal(err)
			}
			if got != c.want {
				t.Errorf("Count = %+v, want %+v", got, c.want)
			}
			s, err := OpenSplits(c.cfg(), Options{Seed: 1})
			if err != nil {
				t.Fatal(err)
			}
			val := 0
			if s.Val != nil {
				val = s.Val.N
			}
			if s.Train.N != got.Train || val != got.Val || s.Test.N != got.Test {
				t.Errorf("OpenSplits holds %d/%d/%d samples, Count says %d/%d/%d", s.Train.N, val, s.Test.N, got.Train, got.Val, got.Test)
			}
		})
	}
	if _, err := Count(synthConfig(filepath.Join(dir, "nowhere"))); err == nil {
		t.Error("Count of a missing directory: no error")
	}
}
