package plot

import (
	"errors"
	"image"
	"image/color"
	"image/draw"
	"image/png"
	"math"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"gonum.org/v1/plot/plotter"

	"github.com/qvd/qvd/internal/metrics"
)

// synthetic returns a run of steps train records with a decaying, noisy loss and an eval
// every evalEvery steps (none if evalEvery is 0). The noise is a fixed pattern, not random,
// so the test is deterministic.
func synthetic(steps, evalEvery int) []metrics.Record {
	var recs []metrics.Record
	for i := 1; i <= steps; i++ {
		loss := 2.3*math.Exp(-float64(i)/float64(steps)*3) + 0.1*math.Sin(float64(i)*1.7)
		recs = append(recs, metrics.Record{Kind: metrics.KindTrain, Step: int64(i), Loss: loss, LR: 1e-3})
		if evalEvery > 0 && i%evalEvery == 0 {
			recs = append(recs, metrics.Record{
				Kind: metrics.KindEval, Step: int64(i), Loss: loss * 1.1,
				Accuracy: 1 - 0.9*math.Exp(-float64(i)/float64(steps)*3), Samples: 10000,
			})
		}
	}
	return recs
}

// decode reads the PNG, checks its size and that it is not one flat colour, and returns it
// as RGBA so the checks below can read pixels directly (At through an interface is slow
// under -race).
func decode(t *testing.T, path string, w, h int) *image.RGBA {
	t.Helper()
	f, err := os.Open(path)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	src, err := png.Decode(f)
	if err != nil {
		t.Fatalf("decoding %s: %v", path, err)
	}
	if b := src.Bounds(); b.Dx() != w || b.Dy() != h {
		t.Fatalf("image is %dx%d, want %dx%d", b.Dx(), b.Dy(), w, h)
	}
	img := image.NewRGBA(image.Rect(0, 0, w, h))
	draw.Draw(img, img.Bounds(), src, src.Bounds().Min, draw.Src)
	if n := colours(img); n < 3 {
		t.Fatalf("image has %d colours: nothing was drawn", n)
	}
	return img
}

func colours(img *image.RGBA) int {
	seen := map[[4]byte]bool{}
	for i := 0; i+3 < len(img.Pix); i += 4 {
		seen[[4]byte(img.Pix[i:i+4])] = true
	}
	return len(seen)
}

// has reports whether some pixel in the given half of the image (top or bottom) is close to c.
func has(img *image.RGBA, c color.RGBA, top bool) bool {
	h := img.Bounds().Dy()
	y0, y1 := 0, h/2
	if !top {
		y0, y1 = h/2, h
	}
	near := func(a, b uint8) bool { d := int(a) - int(b); return d > -8 && d < 8 }
	pix := img.Pix[y0*img.Stride : y1*img.Stride]
	for i := 0; i+3 < len(pix); i += 4 {
		if near(pix[i], c.R) && near(pix[i+1], c.G) && near(pix[i+2], c.B) {
			return true
		}
	}
	return false
}

func TestRenderDefaults(t *testing.T) {
	path := filepath.Join(t.TempDir(), "sub", "run.png")
	if err := Render(synthetic(500, 50), path, DefaultOptions()); err != nil {
		t.Fatal(err)
	}
	img := decode(t, path, 1200, 800)
	for _, c := range []struct {
		name string
		c    color.RGBA
		top  bool
	}{
		{"raw loss", rawLossColor, true},
		{"smoothed loss", smoothLossColor, true},
		{"eval loss", evalLossColor, true},
		{"accuracy", accuracyColor, false},
	} {
		if !has(img, c.c, c.top) {
			t.Errorf("%s colour not found in the %s panel", c.name, map[bool]string{true: "top", false: "bottom"}[c.top])
		}
	}
	if has(img, accuracyColor, true) {
		t.Error("accuracy drawn in the loss panel")
	}
	if st, err := os.Stat(path); err != nil || st.Mode().Perm() != 0o644 {
		t.Fatalf("stat: %v, %v", st, err)
	}
	entries, _ := os.ReadDir(filepath.Dir(path))
	if len(entries) != 1 {
		t.Fatalf("temporary files left behind: %v", entries)
	}
}

func TestRenderSizesAndSmoothing(t *testing.T) {
	dir := t.TempDir()
	path := filepath.Join(dir, "a.png")
	// Zero options: default size, no smoothed curve.
	if err := Render(synthetic(100, 0), path, Options{}); err != nil {
		t.Fatal(err)
	}
	img := decode(t, path, 1200, 800)
	if has(img, smoothLossColor, true) {
		t.Error("Smooth 0 drew a smoothed curve")
	}
	if err := Render(synthetic(100, 10), path, Options{Width: 300, Height: 200, Title: "resnet", Smooth: 0.5}); err != nil {
		t.Fatal(err)
	}
	decode(t, path, 300, 200) // overwrites the earlier plot
}

// small keeps the edge-case renders quick under -race, where rasterizing is ~20x slower.
var small = Options{Width: 400, Height: 300, Smooth: 0.9}

func TestRenderEdgeCases(t *testing.T) {
	nan, inf := math.NaN(), math.Inf(1)
	resumed := synthetic(100, 20)
	// The resumed run restarts at step 61 from a checkpoint and repeats steps 61..100.
	resumed = append(resumed, synthetic(100, 20)[70:]...)
	for name, recs := range map[string][]metrics.Record{
		"no eval records":   synthetic(300, 0),
		"single record":     {{Kind: metrics.KindTrain, Step: 1, Loss: 2.3}},
		"single eval":       {{Kind: metrics.KindEval, Step: 10, Loss: 0.5, Accuracy: 1}},
		"non-finite losses": append(synthetic(50, 10), metrics.Record{Kind: metrics.KindTrain, Step: 51, Loss: nan}, metrics.Record{Kind: metrics.KindTrain, Step: 52, Loss: inf}, metrics.Record{Kind: metrics.KindEval, Step: 52, Loss: nan, Accuracy: 0.5}),
		"resumed run":       resumed,
		"eval only":         {{Kind: metrics.KindEval, Step: 1, Loss: 1, Accuracy: 0.3}, {Kind: metrics.KindEval, Step: 2, Loss: 0.8, Accuracy: 0.5}},
		"negative loss":     {{Kind: metrics.KindTrain, Step: 1, Loss: -1e300}, {Kind: metrics.KindTrain, Step: 2, Loss: 1e300}},
	} {
		t.Run(name, func(t *testing.T) {
			path := filepath.Join(t.TempDir(), "p.png")
			if err := Render(recs, path, small); err != nil {
				t.Fatal(err)
			}
			img := decode(t, path, small.Width, small.Height)
			if name == "single record" && !has(img, rawLossColor, true) {
				t.Error("the single train loss is not visible")
			}
		})
	}
}

// Steps beyond float64's integer precision collapse to one x value; the plotting library
// rejects the range it then computes. That must be an error, not a panic.
func TestRenderHugeSteps(t *testing.T) {
	recs := []metrics.Record{{Kind: metrics.KindTrain, Step: math.MaxInt64, Loss: 1}, {Kind: metrics.KindTrain, Step: math.MaxInt64 - 1, Loss: 2}}
	path := filepath.Join(t.TempDir(), "p.png")
	if err := Render(recs, path, small); err != nil {
		if !strings.Contains(err.Error(), path) {
			t.Fatalf("err = %v, want one naming the file", err)
		}
		return
	}
	decode(t, path, small.Width, small.Height)
}

func TestExtract(t *testing.T) {
	recs := []metrics.Record{
		{Kind: metrics.KindTrain, Step: 2, Loss: 5},
		{Kind: metrics.KindTrain, Step: 1, Loss: 9},
		{Kind: metrics.KindEval, Step: 2, Loss: 3, Accuracy: 0.5},
		{Kind: metrics.KindTrain, Step: 3, Loss: math.NaN()},
		{Kind: "unknown", Step: 4, Loss: 1},
		// resumed: steps 2 and 3 again, with different values; the later ones win
		{Kind: metrics.KindTrain, Step: 2, Loss: 4},
		{Kind: metrics.KindTrain, Step: 3, Loss: 3},
		{Kind: metrics.KindEval, Step: 2, Loss: 2, Accuracy: math.Inf(1)},
	}
	s := extract(recs)
	if got := len(s.trainLoss); got != 3 || s.trainLoss[0].Y != 9 || s.trainLoss[1].Y != 4 || s.trainLoss[2].Y != 3 {
		t.Fatalf("train loss %v", s.trainLoss)
	}
	if len(s.evalLoss) != 1 || s.evalLoss[0].Y != 2 {
		t.Fatalf("eval loss %v", s.evalLoss)
	}
	if len(s.accuracy) != 0 {
		t.Fatalf("non-finite accuracy kept: %v", s.accuracy)
	}
	sm := ema(s.trainLoss, 0.5)
	if sm[0].Y != 9 || sm[1].Y != 6.5 || sm[2].Y != 4.75 {
		t.Fatalf("ema %v", sm)
	}
}

func TestRenderErrors(t *testing.T) {
	dir := t.TempDir()
	path := filepath.Join(dir, "p.png")
	for name, recs := range map[string][]metrics.Record{
		"empty":        nil,
		"only NaN":     {{Kind: metrics.KindTrain, Step: 1, Loss: math.NaN()}},
		"unknown kind": {{Kind: "bogus", Step: 1, Loss: 1}},
	} {
		err := Render(recs, path, DefaultOptions())
		if !errors.Is(err, ErrNoData) || !strings.Contains(err.Error(), path) {
			t.Errorf("%s: err = %v, want ErrNoData naming the file", name, err)
		}
	}
	for _, opt := range []Options{{Width: -1}, {Height: 50}, {Width: 1e6}, {Smooth: 1}, {Smooth: -0.1}, {Smooth: math.NaN()}} {
		err := Render(synthetic(10, 0), path, opt)
		if err == nil || !strings.Contains(err.Error(), "Options.") || !strings.Contains(err.Error(), path) {
			t.Errorf("%+v: err = %v, want one naming the field and the file", opt, err)
		}
	}
	// A destination under a regular file cannot be created.
	blocker := filepath.Join(dir, "file")
	if err := os.WriteFile(blocker, nil, 0o644); err != nil {
		t.Fatal(err)
	}
	bad := filepath.Join(blocker, "p.png")
	if err := Render(synthetic(10, 0), bad, small); err == nil || !strings.Contains(err.Error(), bad) {
		t.Errorf("err = %v, want one naming %s", err, bad)
	}
	if _, err := os.Stat(path); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("a failed Render left %s behind", path)
	}
}

func TestDecimate(t *testing.T) {
	var pts plotter.XYs
	for i := 0; i < 10000; i++ {
		pts = append(pts, plotter.XY{X: float64(i), Y: math.Sin(float64(i) * 0.37)})
	}
	pts[5000].Y = 7 // a spike must survive
	pts[7000].Y = -7
	const buckets = 100
	d := decimate(pts, buckets)
	if len(d) > 2*buckets || len(d) < buckets {
		t.Fatalf("%d points, want between %d and %d", len(d), buckets, 2*buckets)
	}
	var sawHi, sawLo bool
	for i, p := range d {
		if i > 0 && p.X <= d[i-1].X {
			t.Fatalf("points out of order at %d: %v after %v", i, p, d[i-1])
		}
		sawHi = sawHi || p.Y == 7
		sawLo = sawLo || p.Y == -7
	}
	if !sawHi || !sawLo {
		t.Fatal("decimation lost a spike")
	}
	short := pts[:150]
	if got := decimate(short, buckets); len(got) != len(short) {
		t.Fatalf("a short series was decimated to %d points", len(got))
	}
}

func BenchmarkRender100kSteps(b *testing.B) {
	recs := synthetic(100000, 1000)
	path := filepath.Join(b.TempDir(), "p.png")
	for b.Loop() {
		if err := Render(recs, path, DefaultOptions()); err != nil {
			b.Fatal(err)
		}
	}
}
