package data

import (
	"bufio"
	"compress/gzip"
	"fmt"
	"io"
	"math"
	"os"
	"path/filepath"
)

// Sizes is what Count finds of a dataset without reading its samples.
type Sizes struct {
	Shape
	// Train, Val and Test are the samples of each split as a run uses them: after
	// train_subset and test_subset, with data.val_split's (or val/'s) samples in Val and
	// not in Train.
	Train, Val, Test int
	// SampleBytes is what one sample takes where a split is held whole (the images mapped
	// or in memory): C*H*W for 8-bit images, four times that for safetensors F32; 0 for an
	// image folder, whose samples are decoded as batches need them.
	SampleBytes int
	// Mapped and TestMapped: the training (and validation) or the test images are mapped
	// from a file (idx with data.cache and no subset, safetensors U8), so only the pages a
	// run touches become resident.
	Mapped, TestMapped bool
}

// Count describes the data cfg names from headers and file lists: Describe's shape and the
// splits' sizes, for callers that estimate a run without loading it.
func Count(cfg Config) (Sizes, error) {
	shape, err := Describe(cfg)
	if err != nil {
		return Sizes{}, err
	}
	s := Sizes{Shape: shape, SampleBytes: shape.C * shape.H * shape.W}
	switch cfg.Format {
	case FormatImageFolder:
		classes, err := folderClasses(cfg.Path)
		if err != nil {
			return Sizes{}, fmt.Errorf("data: %w", err)
		}
		for _, sp := range []struct {
			name string
			n    *int
		}{{SplitTrain, &s.Train}, {SplitTest, &s.Test}, {SplitVal, &s.Val}} {
			if sp.name == SplitVal {
				if st, err := os.Stat(filepath.Join(cfg.Path, SplitVal)); err != nil || !st.IsDir() {
					continue
				}
			}
			files, err := listFolder(cfg.Path, sp.name, classes)
			if err != nil {
				return Sizes{}, fmt.Errorf("data: %s: %w", sp.name, err)
			}
			*sp.n = len(files)
		}
		s.SampleBytes = 0
	case FormatSafetensors:
		for _, sp := range []struct {
			file string
			n    *int
		}{{SafetensorsTrainFile, &s.Train}, {SafetensorsTestFile, &s.Test}} {
			h, err := readSafetensorsHeader(filepath.Join(cfg.Path, sp.file))
			if err != nil {
				return Sizes{}, fmt.Errorf("data: %w", err)
			}
			*sp.n = h.n
		}
		// Open maps U8 images and reads F32 ones into memory (see loadSafetensors).
		tr, err := readSafetensorsHeader(filepath.Join(cfg.Path, SafetensorsTrainFile))
		if err != nil {
			return Sizes{}, fmt.Errorf("data: %w", err)
		}
		s.Mapped = tr.images.Dtype == "U8"
		s.TestMapped = s.Mapped
		if !s.Mapped {
			s.SampleBytes *= 4
		}
	default:
		for _, sp := range []struct {
			file string
			n    *int
		}{{TrainImagesFile, &s.Train}, {TestImagesFile, &s.Test}} {
			if *sp.n, err = idxCount(cfg, sp.file); err != nil {
				return Sizes{}, err
			}
		}
		// Subsets are read into memory (see loadSplit).
		s.Mapped = cfg.Cache != CacheNone && cfg.TrainSubset == 0
		s.TestMapped = cfg.Cache != CacheNone && cfg.TestSubset == 0
	}
	if cfg.TrainSubset > 0 {
		s.Train = min(s.Train, cfg.TrainSubset)
	}
	if cfg.TestSubset > 0 {
		s.Test = min(s.Test, cfg.TestSubset)
	}
	if cfg.ValSplit > 0 {
		s.Val = int(math.Floor(cfg.ValSplit * float64(s.Train)))
		s.Train -= s.Val
	}
	return s, nil
}

// idxCount reads the sample count from the header of an IDX images file.
func idxCount(cfg Config, name string) (int, error) {
	path := locate(cfg.Path, name)
	f, err := os.Open(path)
	if err != nil {
		return 0, fmt.Errorf("data: %w", withHint(err, cfg))
	}
	defer f.Close()
	br := bufio.NewReader(f)
	var src io.Reader = br
	if head, err := br.Peek(2); err == nil && head[0] == gzipMagic[0] && head[1] == gzipMagic[1] {
		zr, err := gzip.NewReader(br)
		if err != nil {
			return 0, fmt.Errorf("data: read %s: %w", path, classify(err, "gzip header"))
		}
		defer zr.Close()
		src = zr
	}
	dims, _, _, err := readHeader(src, MagicIDXImages)
	if err != nil {
		return 0, fmt.Errorf("data: read %s: %w", path, err)
	}
	return dims[0], nil
}
