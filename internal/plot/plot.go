package plot

import (
	"bufio"
	"errors"
	"fmt"
	"image"
	"image/color"
	"image/png"
	"math"
	"os"
	"path/filepath"
	"slices"

	gplot "gonum.org/v1/plot"
	"gonum.org/v1/plot/plotter"
	"gonum.org/v1/plot/vg"
	"gonum.org/v1/plot/vg/draw"
	"gonum.org/v1/plot/vg/vgimg"

	"github.com/qvd/qvd/internal/metrics"
)

// ErrNoData is returned when the records hold no finite train loss, eval loss or accuracy.
var ErrNoData = errors.New("plot: no finite loss or accuracy to plot")

// Options control the image. Use DefaultOptions and change what you need: in the zero value
// Smooth is 0, which means no smoothing.
type Options struct {
	Width, Height int     // pixels; 0 means the default 1200x800
	Title         string  // title above the loss panel; "" means "training loss"
	Smooth        float64 // EMA factor for the train-loss curve, in [0, 1); 0 = no smoothed curve
}

const (
	defaultWidth, defaultHeight = 1200, 800
	defaultSmooth               = 0.9
	// minSide keeps room for two panels' titles, tick labels and axes; below it the plotting
	// library lays out negative-size canvases.
	minSide = 200
	// maxSide bounds the RGBA buffer (4 bytes a pixel: 10000x10000 is 400 MB).
	maxSide = 10000
	// accuracyMargin is the space left below the lowest accuracy, so its marker is not cut
	// in half by the axis.
	accuracyMargin = 0.02
	// markAtMost is the number of train-loss points up to which each one gets a marker;
	// beyond it markers would merge into a thick smear over the line.
	markAtMost = 50
)

// DefaultOptions returns 1200x800 pixels with an EMA factor of 0.9.
func DefaultOptions() Options {
	return Options{Width: defaultWidth, Height: defaultHeight, Smooth: defaultSmooth}
}

// Validate reports the first option out of range.
func (o Options) Validate() error {
	for _, f := range []struct {
		name string
		v    int
	}{{"Width", o.Width}, {"Height", o.Height}} {
		if f.v != 0 && (f.v < minSide || f.v > maxSide) {
			return fmt.Errorf("plot: Options.%s = %d, want 0 (default) or a value in [%d, %d]", f.name, f.v, minSide, maxSide)
		}
	}
	if !(o.Smooth >= 0 && o.Smooth < 1) {
		return fmt.Errorf("plot: Options.Smooth = %v, want a value in [0, 1)", o.Smooth)
	}
	return nil
}

// Colours: the raw loss is light so the smoothed curve reads on top of it.
var (
	rawLossColor    = color.RGBA{R: 0xa6, G: 0xce, B: 0xe3, A: 0xff}
	smoothLossColor = color.RGBA{R: 0x1f, G: 0x78, B: 0xb4, A: 0xff}
	evalLossColor   = color.RGBA{R: 0xe3, G: 0x1a, B: 0x1c, A: 0xff}
	accuracyColor   = color.RGBA{R: 0x33, G: 0xa0, B: 0x2c, A: 0xff}
)

// series is what Render draws, extracted from the records.
type series struct {
	trainLoss plotter.XYs // by step, finite only
	evalLoss  plotter.XYs
	accuracy  plotter.XYs
}

// Render draws recs into a PNG at pngPath, creating its directory if needed.
func Render(recs []metrics.Record, pngPath string, opt Options) error {
	if err := opt.Validate(); err != nil {
		return fmt.Errorf("rendering %s: %w", pngPath, err)
	}
	if opt.Width == 0 {
		opt.Width = defaultWidth
	}
	if opt.Height == 0 {
		opt.Height = defaultHeight
	}
	if opt.Title == "" {
		opt.Title = "training loss"
	}
	s := extract(recs)
	if len(s.trainLoss) == 0 && len(s.evalLoss) == 0 && len(s.accuracy) == 0 {
		return fmt.Errorf("rendering %s from %d records: %w", pngPath, len(recs), ErrNoData)
	}
	img, err := layout(s, opt)
	if err != nil {
		return fmt.Errorf("rendering %s: %w", pngPath, err)
	}
	if err := writePNG(pngPath, img); err != nil {
		return fmt.Errorf("writing plot %s: %w", pngPath, err)
	}
	return nil
}

// extract keeps the last record of each (kind, step) and returns the finite points by step.
func extract(recs []metrics.Record) series {
	// Later records win: a resumed run rewrites the steps after its checkpoint.
	train := map[int64]metrics.Record{}
	eval := map[int64]metrics.Record{}
	for _, r := range recs {
		switch r.Kind {
		case metrics.KindTrain:
			train[r.Step] = r
		case metrics.KindEval:
			eval[r.Step] = r
		}
	}
	var s series
	for _, step := range sortedKeys(train) {
		if l := train[step].Loss; finite(l) {
			s.trainLoss = append(s.trainLoss, plotter.XY{X: float64(step), Y: l})
		}
	}
	for _, step := range sortedKeys(eval) {
		r := eval[step]
		if finite(r.Loss) {
			s.evalLoss = append(s.evalLoss, plotter.XY{X: float64(step), Y: r.Loss})
		}
		if finite(r.Accuracy) {
			s.accuracy = append(s.accuracy, plotter.XY{X: float64(step), Y: r.Accuracy})
		}
	}
	return s
}

func sortedKeys(m map[int64]metrics.Record) []int64 {
	keys := make([]int64, 0, len(m))
	for k := range m {
		keys = append(keys, k)
	}
	slices.Sort(keys)
	return keys
}

func finite(v float64) bool { return !math.IsNaN(v) && !math.IsInf(v, 0) }

// ema returns the exponential moving average of pts' Y with factor a, seeded with the first
// value (rather than 0, which would drag the start of the curve down towards zero).
func ema(pts plotter.XYs, a float64) plotter.XYs {
	out := make(plotter.XYs, len(pts))
	var s float64
	for i, p := range pts {
		if i == 0 {
			s = p.Y
		} else {
			s = a*s + (1-a)*p.Y
		}
		out[i] = plotter.XY{X: p.X, Y: s}
	}
	return out
}

// decimate reduces pts (sorted by X) to at most two points per bucket of equal X width: the
// lowest and the highest, in their original order. Drawn as a line this covers the same
// pixels as the full series (each column spans its min..max), but a 100k-step run strokes
// a few thousand segments instead of 100k, which the rasterizer is slow at (~2 s).
func decimate(pts plotter.XYs, buckets int) plotter.XYs {
	if buckets < 1 || len(pts) <= 2*buckets {
		return pts
	}
	x0, x1 := pts[0].X, pts[len(pts)-1].X
	width := (x1 - x0) / float64(buckets)
	if !(width > 0) {
		return pts
	}
	out := make(plotter.XYs, 0, 2*buckets)
	bucketOf := func(x float64) int { return min(int((x-x0)/width), buckets-1) }
	start := 0
	for start < len(pts) {
		b := bucketOf(pts[start].X)
		lo, hi, end := start, start, start+1
		for ; end < len(pts) && bucketOf(pts[end].X) == b; end++ {
			if pts[end].Y < pts[lo].Y {
				lo = end
			}
			if pts[end].Y > pts[hi].Y {
				hi = end
			}
		}
		switch {
		case lo == hi:
			out = append(out, pts[lo])
		case lo < hi:
			out = append(out, pts[lo], pts[hi])
		default:
			out = append(out, pts[hi], pts[lo])
		}
		start = end
	}
	return out
}

// layout draws the two panels, stacked, on one image of the requested size.
func layout(s series, opt Options) (img image.Image, err error) {
	// The plotting library panics on inputs it considers programmer errors; for `qvd plot`
	// a strange metrics file must give an error message, not a stack trace.
	defer func() {
		if r := recover(); r != nil {
			img, err = nil, fmt.Errorf("drawing the plot: %v", r)
		}
	}()

	lossPlot, err := lossPanel(s, opt)
	if err != nil {
		return nil, err
	}
	accPlot, err := accuracyPanel(s)
	if err != nil {
		return nil, err
	}
	// One step axis for both panels, so a point in one lines up with the other.
	xmin, xmax := math.Inf(1), math.Inf(-1)
	for _, pts := range []plotter.XYs{s.trainLoss, s.evalLoss, s.accuracy} {
		for _, p := range pts {
			xmin, xmax = math.Min(xmin, p.X), math.Max(xmax, p.X)
		}
	}
	for _, p := range []*gplot.Plot{lossPlot, accPlot} {
		p.X.Min, p.X.Max = xmin, xmax
	}

	// UseImage sizes the canvas from the image at the default DPI, so the PNG has exactly the
	// requested pixel dimensions. The canvas draws on its own copy of the image.
	c := vgimg.NewWith(vgimg.UseImage(image.NewRGBA(image.Rect(0, 0, opt.Width, opt.Height))))
	dc := draw.New(c)
	tiles := draw.Tiles{
		Rows: 2, Cols: 1,
		PadTop: vg.Points(6), PadBottom: vg.Points(6), PadLeft: vg.Points(6), PadRight: vg.Points(12),
		PadY: vg.Points(12),
	}
	plots := [][]*gplot.Plot{{lossPlot}, {accPlot}}
	canvases := gplot.Align(plots, tiles, dc)
	for i := range plots {
		plots[i][0].Draw(canvases[i][0])
	}
	return c.Image(), nil
}

func lossPanel(s series, opt Options) (*gplot.Plot, error) {
	p := gplot.New()
	p.Title.Text = opt.Title
	p.X.Label.Text = "step"
	p.Y.Label.Text = "loss"
	p.Add(plotter.NewGrid())
	// Loss falls from the top left, so the top right is usually empty.
	p.Legend.Top = true

	if len(s.trainLoss) > 0 {
		// One bucket per pixel column of the whole image: an upper bound on the panel's
		// width, so the decimated line looks the same as the full one.
		buckets := opt.Width
		raw, err := plotter.NewLine(decimate(s.trainLoss, buckets))
		if err != nil {
			return nil, fmt.Errorf("train loss line: %w", err)
		}
		raw.LineStyle.Color = rawLossColor
		raw.LineStyle.Width = vg.Points(1)
		p.Add(raw)
		p.Legend.Add("train loss", raw)
		if len(s.trainLoss) <= markAtMost {
			// A line through one point draws nothing, and through a few it hides where the
			// measurements are: mark them.
			pts, err := plotter.NewScatter(s.trainLoss)
			if err != nil {
				return nil, fmt.Errorf("train loss points: %w", err)
			}
			pts.GlyphStyle = draw.GlyphStyle{Color: rawLossColor, Radius: vg.Points(3), Shape: draw.CircleGlyph{}}
			p.Add(pts)
		}
		if opt.Smooth > 0 {
			sm, err := plotter.NewLine(decimate(ema(s.trainLoss, opt.Smooth), buckets))
			if err != nil {
				return nil, fmt.Errorf("smoothed train loss line: %w", err)
			}
			sm.LineStyle.Color = smoothLossColor
			sm.LineStyle.Width = vg.Points(2)
			p.Add(sm)
			p.Legend.Add(fmt.Sprintf("train loss (EMA %g)", opt.Smooth), sm)
		}
	}
	if len(s.evalLoss) > 0 {
		sc, err := plotter.NewScatter(s.evalLoss)
		if err != nil {
			return nil, fmt.Errorf("eval loss points: %w", err)
		}
		sc.GlyphStyle = draw.GlyphStyle{Color: evalLossColor, Radius: vg.Points(3.5), Shape: draw.CircleGlyph{}}
		p.Add(sc)
		p.Legend.Add("eval loss", sc)
	}
	if len(s.trainLoss) == 0 && len(s.evalLoss) == 0 {
		p.Title.Text = opt.Title + " (no finite loss recorded)"
	}
	return p, nil
}

func accuracyPanel(s series) (*gplot.Plot, error) {
	p := gplot.New()
	p.Title.Text = "eval accuracy"
	p.X.Label.Text = "step"
	p.Y.Label.Text = "accuracy"
	p.Add(plotter.NewGrid())
	if len(s.accuracy) == 0 {
		// Keep the panel so the layout does not change between a run's first plot and later
		// ones; say why it is empty.
		p.Title.Text = "eval accuracy (no eval records)"
		p.Y.Min, p.Y.Max = 0, 1
		return p, nil
	}
	line, points, err := plotter.NewLinePoints(s.accuracy)
	if err != nil {
		return nil, fmt.Errorf("accuracy line: %w", err)
	}
	line.LineStyle.Color = accuracyColor
	line.LineStyle.Width = vg.Points(1.5)
	points.GlyphStyle = draw.GlyphStyle{Color: accuracyColor, Radius: vg.Points(3), Shape: draw.CircleGlyph{}}
	p.Add(line, points)

	lo, hi := math.Inf(1), 1.0
	for _, pt := range s.accuracy {
		lo, hi = math.Min(lo, pt.Y), math.Max(hi, pt.Y) // hi > 1 only for a malformed file
	}
	p.Y.Min, p.Y.Max = lo-accuracyMargin, hi
	return p, nil
}

// writePNG encodes img to a temporary file next to path and renames it into place.
func writePNG(path string, img image.Image) (err error) {
	dir := filepath.Dir(path)
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return err
	}
	f, err := os.CreateTemp(dir, "."+filepath.Base(path)+".tmp*")
	if err != nil {
		return err
	}
	defer func() {
		if err != nil {
			f.Close()
			os.Remove(f.Name())
		}
	}()
	bw := bufio.NewWriter(f)
	if err := png.Encode(bw, img); err != nil {
		return fmt.Errorf("encoding PNG: %w", err)
	}
	if err := bw.Flush(); err != nil {
		return err
	}
	// CreateTemp makes the file 0600; a plot is meant to be shared like any other output.
	if err := f.Chmod(0o644); err != nil {
		return err
	}
	if err := f.Close(); err != nil {
		return err
	}
	return os.Rename(f.Name(), path)
}
