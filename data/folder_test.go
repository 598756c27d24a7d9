package data

import (
	"errors"
	"image"
	"image/color"
	"image/jpeg"
	"image/png"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
)

// writePNG writes img to root/rel as PNG, creating the directories.
func writePNG(t testing.TB, root, rel string, img image.Image) {
	t.Helper()
	p := filepath.Join(root, rel)
	if err := os.MkdirAll(filepath.Dir(p), 0o755); err != nil {
		t.Fatal(err)
	}
	f, err := os.Create(p)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	if strings.HasSuffix(p, ".jpg") {
		err = jpeg.Encode(f, img, &jpeg.Options{Quality: 100})
	} else {
		err = png.Encode(f, img)
	}
	if err != nil {
		t.Fatal(err)
	}
}

// grayImage is an h×w grey image whose pixel (y, x) is base + y*w + x.
func grayImage(h, w int, base uint8) *image.Gray {
	g := image.NewGray(image.Rect(0, 0, w, h))
	for i := range g.Pix {
		g.Pix[i] = base + uint8(i)
	}
	return g
}

// grayFolder writes a three-class grey image folder of 6x5 images: train holds 2 samples per
// class, test 1, named so that the sample order interleaves the classes.
func grayFolder(t testing.TB) string {
	root := t.TempDir()
	for c, class := range []string{"ankle", "bag", "coat"} {
		for k := range 2 {
			name := []string{"a", "b"}[k] + ".png"
			writePNG(t, root, filepath.Join("train", class, name), grayImage(6, 5, uint8(100*k+10*c)))
		}
		writePNG(t, root, filepath.Join("test", class, "x.png"), grayImage(6, 5, uint8(50+c)))
	}
	os.WriteFile(filepath.Join(root, "train", "README.txt"), []byte("not a class"), 0o644)
	os.WriteFile(filepath.Join(root, "train", "bag", "notes.txt"), []byte("not an image"), 0o644)
	return root
}

func folderConfig(root string) Config {
	cfg := DefaultConfig()
	cfg.Format, cfg.Path, cfg.Dataset = FormatImageFolder, root, "synthetic"
	cfg.Normalize = DefaultConfig().Normalize
	return cfg
}

func TestImageFolderLoad(t *testing.T) {
	cfg := folderConfig(grayFolder(t))
	cfg.Mean, cfg.Std = []float32{0.5}, []float32{0.25}
	train, test, err := Load(cfg)
	if err != nil {
		t.Fatal(err)
	}
	if train.N != 6 || test.N != 3 || train.C != 1 || train.H != 6 || train.W != 5 || train.Classes != 3 ||
		strings.Join(train.ClassNames, ",") != "ankle,bag,coat" || train.Images != nil {
		t.Fatalf("train %+v", *train)
	}
	// Ordered by file name, then class: a.png of each class, then b.png of each.
	if got := string(train.Labels); got != "\x00\x01\x02\x00\x01\x02" {
		t.Fatalf("labels %v", train.Labels)
	}
	if s, err := Describe(cfg); err != nil || s != (Shape{C: 1, H: 6, W: 5, Classes: 3}) {
		t.Fatalf("Describe = %+v, %v", s, err)
	}
	norm, err := cfg.Norm(train.C)
	if err != nil {
		t.Fatal(err)
	}
	b := NewBatch(3, train.SampleSize())
	if err := train.Fill(b, []int32{4, 0}, norm); err != nil {
		t.Fatal(err)
	}
	for r, want := range []*image.Gray{grayImage(6, 5, 110), grayImage(6, 5, 0)} {
		for k, p := range want.Pix {
			if got := b.X[r*30+k]; got != wantValue(p, Normalize{Mean: 0.5, Std: 0.25}) {
				t.Fatalf("row %d value %d = %g, want pixel %d normalised", r, k, got, p)
			}
		}
	}
	if b.N != 2 || b.Y[0] != 1 || b.Y[1] != 0 || b.X[2*30] != 0 {
		t.Fatalf("batch N %d labels %v", b.N, b.Y)
	}
	// FillRange agrees with Fill.
	rb := NewBatch(3, train.SampleSize())
	if err := test.FillRange(rb, 0, 3, norm); err != nil {
		t.Fatal(err)
	}
	fb := NewBatch(3, train.SampleSize())
	if err := test.Fill(fb, []int32{0, 1, 2}, norm); err != nil {
		t.Fatal(err)
	}
	for k := range rb.X {
		if rb.X[k] != fb.X[k] {
			t.Fatalf("FillRange and Fill differ at %d", k)
		}
	}
}

// TestImageFolderErrors: a bad layout is an error naming the folders at fault.
func TestImageFolderErrors(t *testing.T) {
	for _, c := range []struct {
		name  string
		edit  func(root string)
		wants []string
	}{
		{"empty class", func(root string) {
			os.MkdirAll(filepath.Join(root, "train", "dress"), 0o755)
			os.MkdirAll(filepath.Join(root, "test", "dress"), 0o755)
		}, []string{filepath.Join("train", "dress") + " holds no .png"}},
		{"class missing from test", func(root string) {
			os.RemoveAll(filepath.Join(root, "test", "bag"))
		}, []string{"test has other classes", "missing class folders bag"}},
		{"extra class in test", func(root string) {
			writePNG(t, root, filepath.Join("test", "zebra", "x.png"), grayImage(6, 5, 0))
		}, []string{"class folders zebra that", "lacks"}},
		{"no classes", func(root string) {
			for _, c := range []string{"ankle", "bag", "coat"} {
				os.RemoveAll(filepath.Join(root, "train", c))
			}
		}, []string{filepath.Join("train") + " holds no class folders"}},
		{"no test split", func(root string) { os.RemoveAll(filepath.Join(root, "test")) }, []string{filepath.Join("test") + ": no such file"}},
		{"subset too large", nil, []string{"train_subset: 7 exceeds the 6 samples"}},
	} {
		t.Run(c.name, func(t *testing.T) {
			root := grayFolder(t)
			cfg := folderConfig(root)
			if c.edit != nil {
				c.edit(root)
			} else {
				cfg.TrainSubset = 7
			}
			_, _, err := Load(cfg)
			for _, w := range c.wants {
				if err == nil || !strings.Contains(err.Error(), w) {
					t.Fatalf("Load: %v, want it to contain %q", err, w)
				}
			}
		})
	}
}

// TestImageFolderBadFile: an undecodable file is skipped (its row holds the next sample,
// reported once and counted) or, with on_error: fail, fails the fill naming the file.
func TestImageFolderBadFile(t *testing.T) {
	root := grayFolder(t)
	bad := filepath.Join(root, "train", "bag", "a.png") // sample 1
	os.WriteFile(bad, []byte("\x89PNG\r\n\x1a\n garbage"), 0o644)
	cfg := folderConfig(root)
	var mu sync.Mutex
	var warned []error
	train, _, err := Open(cfg, Options{Warn: func(err error) { mu.Lock(); warned = append(warned, err); mu.Unlock() }})
	if err != nil {
		t.Fatal(err)
	}
	b := NewBatch(3, train.SampleSize())
	for range 2 { // the second time the bad file is known and not read again
		if err := train.Fill(b, []int32{1, 1, 0}, Normalize{Mean: 0, Std: 1}); err != nil {
			t.Fatal(err)
		}
	}
	if b.N != 3 || b.Y[0] != 2 || b.Y[1] != 2 || b.Y[2] != 0 {
		t.Fatalf("skipped row should hold sample 2 (coat): labels %v", b.Y)
	}
	if want := float32(20) / 255; b.X[0] != want {
		t.Fatalf("skipped row's first value %g, want sample 2's %g", b.X[0], want)
	}
	if train.Skipped() != 1 || len(warned) != 1 || !strings.Contains(warned[0].Error(), bad) {
		t.Fatalf("skipped %d, warnings %v", train.Skipped(), warned)
	}

	cfg.OnError = OnErrorFail
	train, _, err = Load(cfg)
	if err != nil {
		t.Fatal(err)
	}
	err = train.Fill(b, []int32{0, 1}, Normalize{Mean: 0, Std: 1})
	if err == nil || !strings.Contains(err.Error(), bad) || !errors.Is(err, ErrCorrupt) {
		t.Fatalf("on_error fail: %v", err)
	}
	if b.N != 0 {
		t.Fatalf("a failed fill leaves %d rows", b.N)
	}
}

// TestImageFolderRGBResize: colour images become planar R, G, B; channels 1 converts them to
// grey; image_size resizes; mean and std apply per channel.
func TestImageFolderRGBResize(t *testing.T) {
	root := t.TempDir()
	img := image.NewNRGBA(image.Rect(0, 0, 4, 4))
	for i := range 16 {
		img.Pix[4*i], img.Pix[4*i+1], img.Pix[4*i+2], img.Pix[4*i+3] = 200, 100, 50, 255
	}
	for _, class := range []string{"a", "b"} {
		writePNG(t, root, filepath.Join("train", class, "1.png"), img)
		writePNG(t, root, filepath.Join("test", class, "1.png"), img)
	}
	cfg := folderConfig(root)
	cfg.ImageSize = []int{2, 3}
	cfg.Mean, cfg.Std = []float32{0, 0.5, 0}, []float32{1, 1, 0.5}
	train, _, err := Load(cfg)
	if err != nil {
		t.Fatal(err)
	}
	if train.Shape() != (Shape{C: 3, H: 2, W: 3, Classes: 2}) {
		t.Fatalf("shape %+v", train.Shape())
	}
	norm, err := cfg.Norm(3)
	if err != nil {
		t.Fatal(err)
	}
	b := NewBatch(1, train.SampleSize())
	if err := train.Fill(b, []int32{0}, norm); err != nil {
		t.Fatal(err)
	}
	want := []float32{float32(200.0 / 255), float32(100.0/255 - 0.5), float32(50.0 / 255 / 0.5)}
	for k, v := range b.X[:18] {
		if d := v - want[k/6]; d > 1e-6 || d < -1e-6 {
			t.Fatalf("value %d (channel %d) = %g, want %g", k, k/6, v, want[k/6])
		}
	}
	cfg.Channels, cfg.Mean, cfg.Std = 1, nil, nil
	train, _, err = Load(cfg)
	if err != nil || train.C != 1 {
		t.Fatalf("channels 1: %v, C %d", err, train.C)
	}
	norm, _ = cfg.Norm(1)
	b = NewBatch(1, train.SampleSize())
	if err := train.Fill(b, []int32{0}, norm); err != nil {
		t.Fatal(err)
	}
	grey := color.GrayModel.Convert(color.NRGBA{200, 100, 50, 255}).(color.Gray).Y
	if b.X[0] != float32(float64(grey)/255) {
		t.Fatalf("grey %g, want %d/255", b.X[0], grey)
	}
	cfg.Mean = []float32{0, 0}
	if _, _, err := Load(cfg); err == nil || !strings.Contains(err.Error(), "data.mean: 2 values for samples of 1 channels") {
		t.Fatalf("mean of the wrong length: %v", err)
	}
}

func TestImageFolderJPEG(t *testing.T) {
	root := t.TempDir()
	for _, class := range []string{"a", "b"} {
		writePNG(t, root, filepath.Join("train", class, "1.jpg"), grayImage(8, 8, 0))
		writePNG(t, root, filepath.Join("test", class, "1.jpg"), grayImage(8, 8, 0))
	}
	train, _, err := Load(folderConfig(root))
	if err != nil {
		t.Fatal(err)
	}
	b := NewBatch(2, train.SampleSize())
	if err := train.Fill(b, []int32{0, 1}, Normalize{Mean: 0, Std: 1}); err != nil || train.C != 1 || train.Skipped() != 0 {
		t.Fatalf("JPEG: %v, C %d", err, train.C)
	}
}

func TestResizeBilinear(t *testing.T) {
	for _, c := range []struct {
		name           string
		src            []uint8
		sh, sw, dh, dw int
		want           []uint8
	}{
		{"same size copies", []uint8{1, 2, 3, 4}, 2, 2, 2, 2, []uint8{1, 2, 3, 4}},
		// Pixel centres: dst x=0 maps to src -0.25 (clamped to 0), x=1 to 0.25, x=2 to 0.75,
		// x=3 to 1.25 → 0, 25, 75, 100 between 0 and 100.
		{"upscale a row", []uint8{0, 100}, 1, 2, 1, 4, []uint8{0, 25, 75, 100}},
		{"constant stays constant", []uint8{7, 7, 7, 7, 7, 7}, 2, 3, 5, 4, []uint8{7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7}},
		// Halving: each dst pixel sits between two src pixels → their mean (rounded).
		{"downscale averages pairs", []uint8{0, 10, 20, 31}, 1, 4, 1, 2, []uint8{5, 26}},
		{"column", []uint8{0, 200}, 2, 1, 4, 1, []uint8{0, 50, 150, 200}},
	} {
		t.Run(c.name, func(t *testing.T) {
			dst := make([]uint8, c.dh*c.dw)
			resizeBilinear(dst, c.src, 1, c.sh, c.sw, c.dh, c.dw)
			if string(dst) != string(c.want) {
				t.Fatalf("got %v, want %v", dst, c.want)
			}
		})
	}
}

func TestAugment(t *testing.T) {
	// 1 channel, 3x3: values 1..9.
	src := []uint8{1, 2, 3, 4, 5, 6, 7, 8, 9}
	for _, c := range []struct {
		name string
		t    transform
		pad  int
		want []uint8
	}{
		{"centre crop is the identity", transform{dy: 1, dx: 1}, 1, src},
		{"shift down-right shows top-left padding", transform{dy: 0, dx: 0}, 1, []uint8{0, 0, 0, 0, 1, 2, 0, 4, 5}},
		{"shift up-left", transform{dy: 2, dx: 2}, 1, []uint8{5, 6, 0, 8, 9, 0, 0, 0, 0}},
		{"flip", transform{dy: 1, dx: 1, flip: true}, 1, []uint8{3, 2, 1, 6, 5, 4, 9, 8, 7}},
		{"crop then flip", transform{dy: 0, dx: 0, flip: true}, 1, []uint8{0, 0, 0, 2, 1, 0, 5, 4, 0}},
	} {
		t.Run(c.name, func(t *testing.T) {
			dst := make([]uint8, 9)
			apply(dst, src, 1, 3, 3, c.pad, c.t)
			if string(dst) != string(c.want) {
				t.Fatalf("got %v, want %v", dst, c.want)
			}
		})
	}
	a := AugmentConfig{CropPadding: 4, HFlip: true}
	same := a.draw(Draw{Seed: 1, Epoch: 2}, 7) == a.draw(Draw{Seed: 1, Epoch: 2}, 7)
	var differ, flips int
	for i := range 200 {
		x, y := a.draw(Draw{Seed: 1, Epoch: 2}, i), a.draw(Draw{Seed: 1, Epoch: 3}, i)
		if x != y {
			differ++
		}
		if x.flip {
			flips++
		}
		if x.dy < 0 || x.dy > 8 || x.dx < 0 || x.dx > 8 {
			t.Fatalf("crop offset %+v outside [0, 8]", x)
		}
	}
	if !same || differ < 190 || flips < 70 || flips > 130 {
		t.Fatalf("draws: deterministic %v, %d/200 differ between epochs, %d/200 flip", same, differ, flips)
	}
}

// TestFillAugmented: augmentation applies to FillAugmented on the training split only, is
// the same whatever the batch a sample is in, and Fill never augments.
func TestFillAugmented(t *testing.T) {
	cfg := folderConfig(grayFolder(t))
	cfg.Augment = AugmentConfig{CropPadding: 2, HFlip: true}
	train, test, err := Load(cfg)
	if err != nil {
		t.Fatal(err)
	}
	norm := Normalize{Mean: 0, Std: 1}
	at := Draw{Seed: 9, Epoch: 1}
	one, two := NewBatch(1, 30), NewBatch(2, 30)
	if err := train.FillAugmented(one, []int32{3}, norm, at); err != nil {
		t.Fatal(err)
	}
	if err := train.FillAugmented(two, []int32{5, 3}, norm, at); err != nil {
		t.Fatal(err)
	}
	plain := NewBatch(1, 30)
	train.Fill(plain, []int32{3}, norm)
	changed := false
	for k := range 30 {
		if one.X[k] != two.X[30+k] {
			t.Fatalf("sample 3 augmented differently in another batch at %d", k)
		}
		changed = changed || one.X[k] != plain.X[k]
	}
	tr := cfg.Augment.draw(at, 3)
	if !changed && tr != (transform{dy: 2, dx: 2}) {
		t.Fatalf("augmentation %+v left the sample unchanged", tr)
	}
	tb := NewBatch(1, 30)
	test.FillAugmented(tb, []int32{0}, norm, at)
	test.Fill(plain, []int32{0}, norm)
	for k := range 30 {
		if tb.X[k] != plain.X[k] {
			t.Fatal("the test split was augmented")
		}
	}
}

func TestConfigValidateFormats(t *testing.T) {
	for _, c := range []struct {
		edit func(*Config)
		want string // "" = valid
	}{
		{func(c *Config) { c.Format = FormatImageFolder; c.Path = "/x"; c.Dataset = "pets" }, ""},
		{func(c *Config) { c.Format = "csv" }, "format: unknown format \"csv\""},
		{func(c *Config) { c.Format = FormatImageFolder }, "path: format image-folder needs the directory"},
		{func(c *Config) { c.Format = FormatSafetensors; c.Path = "" }, "path: format safetensors needs"},
		{func(c *Config) { c.Format = FormatImageFolder; c.Path = "/x"; c.Normalize.Mean = 0.5 }, "normalize: applies to format idx only"},
		{func(c *Config) { c.Mean = []float32{0.1, 0.2, 0.3, 0.4, 0.5} }, "mean: one value, or one per channel"},
		{func(c *Config) { c.Std = []float32{1, 0} }, "std[1]: must be finite and > 0"},
		{func(c *Config) { c.Mean, c.Std = []float32{1, 2}, []float32{1, 2, 3} }, "mean, std: 2 and 3 values"},
		{func(c *Config) { c.Format = FormatImageFolder; c.Path = "/x"; c.Channels = 2 }, "channels: must be 1"},
		{func(c *Config) { c.Format = FormatImageFolder; c.Path = "/x"; c.ImageSize = []int{32} }, "image_size: must be [H, W]"},
		{func(c *Config) { c.Channels = 3 }, "channels, image_size: only used by format image-folder"},
		{func(c *Config) { c.Augment.CropPadding = -1 }, "augment.crop_padding: must be in [0, 64]"},
		{func(c *Config) { c.OnError = "ignore" }, "on_error: must be skip or fail"},
	} {
		cfg := DefaultConfig()
		c.edit(&cfg)
		err := cfg.Validate()
		if (c.want == "") != (err == nil) || (err != nil && !strings.HasPrefix(err.Error(), c.want)) {
			t.Errorf("Validate() = %v, want %q", err, c.want)
		}
	}
}

func TestConfigNorm(t *testing.T) {
	idx := DefaultConfig()
	if n, err := idx.Norm(1); err != nil || n.Mean != FashionMNISTMean || n.Std != FashionMNISTStd || n.PerChannel != nil {
		t.Fatalf("idx default: %+v %v", n, err)
	}
	folder := idx
	folder.Format = FormatImageFolder
	if n, err := folder.Norm(3); err != nil || n.Mean != 0 || n.Std != 1 {
		t.Fatalf("image-folder default: %+v %v", n, err)
	}
	folder.Mean, folder.Std = []float32{0.5}, []float32{0.1, 0.2, 0.3}
	n, err := folder.Norm(3)
	if c2 := n.channel(2); err != nil || len(n.PerChannel) != 3 || c2.Mean != 0.5 || c2.Std != 0.3 {
		t.Fatalf("per channel: %+v %v", n, err)
	}
	if _, err := folder.Norm(1); err == nil || !strings.Contains(err.Error(), "data.std: 3 values") {
		t.Fatalf("std for 3 channels on 1: %v", err)
	}
}

// TestReadImageErrors: the exported decoder refuses a buffer of the wrong size, and a file
// that is not an image is ErrBadData naming it (qvd predict reports both).
func TestReadImageErrors(t *testing.T) {
	dir := t.TempDir()
	bad := filepath.Join(dir, "not-an-image.png")
	if err := os.WriteFile(bad, []byte("plain text"), 0o644); err != nil {
		t.Fatal(err)
	}
	if err := ReadImage(make([]uint8, 10), bad, 1, 4, 4); err == nil || !strings.Contains(err.Error(), "buffer of 10 bytes") {
		t.Errorf("a 10-byte buffer for 1×4×4: %v", err)
	}
	if err := ReadImage(make([]uint8, 16), bad, 1, 4, 4); !errors.Is(err, ErrBadData) || !strings.Contains(err.Error(), "not-an-image.png") {
		t.Errorf("a text file: %v, want ErrBadData naming the file", err)
	}
}
