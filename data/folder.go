package data

import (
	"bufio"
	"errors"
	"fmt"
	"image"
	"image/color"
	_ "image/jpeg" // registers JPEG with image.Decode
	_ "image/png"  // registers PNG with image.Decode
	"os"
	"path/filepath"
	"slices"
	"strings"
)

// Image folders (format image-folder) are laid out as torchvision's ImageFolder expects:
//
//	PATH/train/CLASS/NAME.png|.jpg|.jpeg
//	PATH/test/CLASS/...
//	PATH/val/CLASS/...    (optional: the validation split)
//
// The classes are the sorted names of train/'s sub-directories, label 0 first; test/ must
// have the same ones. Nothing but the file list is read at load: a sample is decoded when a
// batch needs it, so the images are never all in memory, and the bounded Prefetcher hides
// the decoding behind the step.
//
// A split's samples are ordered by file name, then class, not class by class: files named by
// their index (as an export of an indexed dataset is) keep that order, and the first N
// samples (train_subset) mix the classes rather than taking the first classes whole. The
// training order itself is Permutation's, over these indices, as for every format.

// SplitTrain, SplitTest and SplitVal name the sub-directories of an image folder; val/ is
// optional.
const (
	SplitTrain = "train"
	SplitTest  = "test"
	SplitVal   = "val"
)

// imageExts are the file name extensions an image folder's samples have (matched without
// regard to case); other files are ignored.
var imageExts = []string{".png", ".jpg", ".jpeg"}

// folderSample is one file of a split and its label.
type folderSample struct {
	path  string
	label uint8
}

// listFolder lists the classes of root/train and the samples of the named split, in sample
// order. Every class folder must exist in the split and hold at least one image; the errors
// name the folders.
func listFolder(root, split string, classes []string) ([]folderSample, error) {
	dir := filepath.Join(root, split)
	present, err := subdirs(dir)
	if err != nil {
		return nil, err
	}
	if missing, extra := setDiff(classes, present), setDiff(present, classes); len(missing)+len(extra) > 0 {
		var parts []string
		if len(missing) > 0 {
			parts = append(parts, fmt.Sprintf("missing class folders %s", strings.Join(missing, ", ")))
		}
		if len(extra) > 0 {
			parts = append(parts, fmt.Sprintf("class folders %s that %s lacks", strings.Join(extra, ", "), filepath.Join(root, SplitTrain)))
		}
		return nil, fmt.Errorf("%w: %s has other classes than %s: %s", ErrBadData, dir, filepath.Join(root, SplitTrain), strings.Join(parts, "; "))
	}
	type named struct {
		name string
		folderSample
	}
	var all []named
	for label, class := range classes {
		entries, err := os.ReadDir(filepath.Join(dir, class))
		if err != nil {
			return nil, err
		}
		n := 0
		for _, e := range entries {
			if e.IsDir() || !slices.Contains(imageExts, strings.ToLower(filepath.Ext(e.Name()))) {
				continue
			}
			all = append(all, named{e.Name(), folderSample{filepath.Join(dir, class, e.Name()), uint8(label)}})
			n++
		}
		if n == 0 {
			return nil, fmt.Errorf("%w: class folder %s holds no %s files", ErrBadData, filepath.Join(dir, class), strings.Join(imageExts, ", "))
		}
	}
	slices.SortFunc(all, func(a, b named) int {
		if c := strings.Compare(a.name, b.name); c != 0 {
			return c
		}
		return int(a.label) - int(b.label)
	})
	out := make([]folderSample, len(all))
	for i, s := range all {
		out[i] = s.folderSample
	}
	return out, nil
}

// subdirs returns the sorted names of dir's sub-directories.
func subdirs(dir string) ([]string, error) {
	entries, err := os.ReadDir(dir)
	if err != nil {
		return nil, err
	}
	var names []string
	for _, e := range entries {
		if e.IsDir() {
			names = append(names, e.Name())
		}
	}
	slices.Sort(names)
	return names, nil
}

// setDiff is the names in a that b lacks; both sorted.
func setDiff(a, b []string) []string {
	var out []string
	for _, s := range a {
		if _, found := slices.BinarySearch(b, s); !found {
			out = append(out, s)
		}
	}
	return out
}

// folderClasses returns the class names of root/train.
func folderClasses(root string) ([]string, error) {
	classes, err := subdirs(filepath.Join(root, SplitTrain))
	if err != nil {
		return nil, err
	}
	switch {
	case len(classes) == 0:
		return nil, fmt.Errorf("%w: %s holds no class folders (want %s/CLASS/*.png)", ErrBadData, filepath.Join(root, SplitTrain), SplitTrain)
	case len(classes) > MaxClasses:
		return nil, fmt.Errorf("%w: %s holds %d class folders, more than the %d supported", ErrBadData, filepath.Join(root, SplitTrain), len(classes), MaxClasses)
	}
	return classes, nil
}

// folderShape is the sample shape: cfg.Channels and cfg.ImageSize, or where unset the first
// training image's colour (grey → 1, else 3) and size, read from its header only.
func folderShape(cfg Config, first string) (c, h, w int, err error) {
	c = cfg.Channels
	if len(cfg.ImageSize) == 2 {
		h, w = cfg.ImageSize[0], cfg.ImageSize[1]
	}
	if c != 0 && h != 0 {
		return c, h, w, nil
	}
	f, err := os.Open(first)
	if err != nil {
		return 0, 0, 0, err
	}
	defer f.Close()
	ic, _, err := image.DecodeConfig(bufio.NewReader(f))
	if err != nil {
		return 0, 0, 0, fmt.Errorf("%w: %s, the first training image, sets the sample shape but cannot be decoded: %v (set data.channels and data.image_size, or replace it)", ErrBadData, first, err)
	}
	if c == 0 {
		c = 3
		if ic.ColorModel == color.GrayModel || ic.ColorModel == color.Gray16Model {
			c = 1
		}
	}
	if h == 0 {
		h, w = ic.Height, ic.Width
	}
	if h < 1 || w < 1 || h > MaxIDXSide || w > MaxIDXSide {
		return 0, 0, 0, fmt.Errorf("%w: %s is %dx%d; image sides must be in [1, %d]", ErrBadData, first, h, w, MaxIDXSide)
	}
	return c, h, w, nil
}

// loadFolder opens the splits of an image folder: the file lists and labels, not the
// pixels. A val/ folder, where there is one, is the validation split.
func loadFolder(cfg Config, skips *skipLog) (Splits, error) {
	classes, err := folderClasses(cfg.Path)
	if err != nil {
		return Splits{}, fmt.Errorf("data: %w", err)
	}
	trainFiles, err := listFolder(cfg.Path, SplitTrain, classes)
	if err != nil {
		return Splits{}, fmt.Errorf("data: train: %w", err)
	}
	testFiles, err := listFolder(cfg.Path, SplitTest, classes)
	if err != nil {
		return Splits{}, fmt.Errorf("data: test: %w", err)
	}
	var valFiles []folderSample
	if st, err := os.Stat(filepath.Join(cfg.Path, SplitVal)); err == nil && st.IsDir() {
		if cfg.ValSplit > 0 {
			return Splits{}, fmt.Errorf("data: val_split: %s holds the validation split already; set val_split to 0, or remove the folder to hold out %g of train/", filepath.Join(cfg.Path, SplitVal), cfg.ValSplit)
		}
		if valFiles, err = listFolder(cfg.Path, SplitVal, classes); err != nil {
			return Splits{}, fmt.Errorf("data: val: %w", err)
		}
	}
	c, h, w, err := folderShape(cfg, trainFiles[0].path)
	if err != nil {
		return Splits{}, fmt.Errorf("data: %w", err)
	}
	mk := func(files []folderSample, subset int, field string) (*Dataset, error) {
		if subset > len(files) {
			return nil, fmt.Errorf("data: %s: %d exceeds the %d samples in the folder", field, subset, len(files))
		}
		if subset > 0 {
			files = files[:subset]
		}
		src := &folderSource{c: c, h: h, w: w, paths: make([]string, len(files))}
		labels := make([]uint8, len(files))
		for i, f := range files {
			src.paths[i], labels[i] = f.path, f.label
		}
		return &Dataset{
			Name: cfg.Dataset, N: len(files), C: c, H: h, W: w, Classes: len(classes), ClassNames: classes,
			Labels: labels, src: src, skips: skips,
		}, nil
	}
	var s Splits
	if s.Train, err = mk(trainFiles, cfg.TrainSubset, "train_subset"); err != nil {
		return Splits{}, err
	}
	if s.Test, err = mk(testFiles, cfg.TestSubset, "test_subset"); err != nil {
		return Splits{}, err
	}
	if valFiles != nil {
		if s.Val, err = mk(valFiles, 0, ""); err != nil {
			return Splits{}, err
		}
	}
	return s, nil
}

// folderSource decodes samples from their files, converted to c channels and resized to
// h × w. Safe for concurrent use: it only reads its fields.
type folderSource struct {
	c, h, w int
	paths   []string
}

func (s *folderSource) read(i int, dst []uint8) error {
	return ReadImage(dst, s.paths[i], s.c, s.h, s.w)
}

// ReadImage decodes the PNG or JPEG file at path into dst (c × h × w bytes) as an image
// folder's sample is: c planes (1: grey by BT.601 luma, 3: R, G, B), resized bilinearly when
// the file has another size. qvd predict reads its images through it, so a model sees the
// same pixels at inference as in training. Errors wrap ErrBadData where the file is at fault.
func ReadImage(dst []uint8, path string, c, h, w int) error {
	if len(dst) != c*h*w {
		return fmt.Errorf("data: reading %s: a buffer of %d bytes for %d × %d × %d", path, len(dst), c, h, w)
	}
	f, err := os.Open(path)
	if err != nil {
		return err
	}
	defer f.Close()
	img, _, err := image.Decode(bufio.NewReader(f))
	if err != nil {
		return fmt.Errorf("%w: decoding %s: %v", ErrBadData, path, err)
	}
	b := img.Bounds()
	if b.Dy() == h && b.Dx() == w {
		planar(dst, img, c)
		return nil
	}
	if b.Empty() {
		return fmt.Errorf("%w: %s is an empty image", ErrBadData, path)
	}
	tmp := make([]uint8, c*b.Dy()*b.Dx())
	planar(tmp, img, c)
	resizeBilinear(dst, tmp, c, b.Dy(), b.Dx(), h, w)
	return nil
}

func (s *folderSource) name(i int) string { return s.paths[i] }

var _ source = (*folderSource)(nil)

// ErrBadData is wrapped by the content errors of image folders and safetensors files (a bad
// layout, an undecodable image, a tensor of the wrong dtype or shape). It is ErrCorrupt
// under another message: errors.Is(err, ErrCorrupt) holds for it too.
var ErrBadData error = badData("bad dataset")

type badData string

func (e badData) Error() string        { return string(e) }
func (e badData) Is(target error) bool { return target == ErrCorrupt }

// errAllBad is returned when no sample of a split can be read.
var errAllBad = errors.New("no sample of the split can be read")
