package main

import (
	"bufio"
	"encoding/json"
	"fmt"
	"image"
	"image/color"
	_ "image/jpeg" // registers JPEG with image.Decode
	_ "image/png"  // registers PNG with image.Decode
	"io"
	"math"
	"os"

	"github.com/qvd/qvd/data"
	"github.com/qvd/qvd/model"
)

// prediction is one image's top-k classes, as qvd predict --json prints them.
type prediction struct {
	Image string      `json:"image"`
	Top   []predClass `json:"top"`
}

type predClass struct {
	Class int     `json:"class"`
	Name  string  `json:"name"`
	Prob  float64 `json:"probability"`
}

func cmdPredict(args []string, stdout, stderr io.Writer) int {
	fs := newFlagSet("predict")
	var f inferenceFlags
	f.register(fs)
	topK := fs.Int("top-k", 3, "how many of the most probable classes to print per image")
	asJSON := fs.Bool("json", false, "print the predictions as JSON lines, one per image")
	// Images and flags may come in any order: flag parsing stops at the first image, so go on
	// after it.
	var images []string
	for rest := args; ; {
		if code, ok := parseFlags(fs, rest, stdout, stderr); !ok {
			return code
		}
		if fs.NArg() == 0 {
			break
		}
		images, rest = append(images, fs.Arg(0)), fs.Args()[1:]
	}
	if len(images) == 0 {
		return usageError(fs, stderr, "give one or more PNG or JPEG images")
	}
	if *topK < 1 {
		return usageError(fs, stderr, "--top-k must be >= 1, got %d", *topK)
	}
	// The model's input shape and class names come from the dataset: one test sample is enough.
	inf, err := f.load(1, func(s string) { fmt.Fprintf(stderr, "warning: %s\n", s) })
	if err != nil {
		return inferenceFailed("predict", stderr, err)
	}
	c, h, w := inf.spec.Input[0], inf.spec.Input[1], inf.spec.Input[2]
	x := make([]float32, len(images)*c*h*w)
	for i, path := range images {
		if err := loadImage(x[i*c*h*w:][:c*h*w], path, c, h, w, inf.norm); err != nil {
			return inferenceFailed("predict", stderr, err)
		}
	}
	classes := inf.spec.Classes
	logits := make([]float32, len(images)*classes)
	if err := model.Forward(logits, inf.spec, inf.layout, inf.params, x, len(images)); err != nil {
		return inferenceFailed("predict", stderr, err)
	}
	enc := json.NewEncoder(stdout)
	for i, path := range images {
		top, err := model.TopK(logits[i*classes:(i+1)*classes], *topK)
		if err != nil {
			return inferenceFailed("predict", stderr, err)
		}
		p := prediction{Image: path}
		for _, r := range top {
			p.Top = append(p.Top, predClass{Class: r.Class, Name: inf.names[r.Class], Prob: r.Prob})
		}
		if *asJSON {
			if err := enc.Encode(p); err != nil {
				return inferenceFailed("predict", stderr, err)
			}
			continue
		}
		fmt.Fprintf(stdout, "%s\n", path)
		for _, t := range p.Top {
			fmt.Fprintf(stdout, "  %6.4f  %d %s\n", t.Prob, t.Class, t.Name)
		}
	}
	return exitOK
}

// loadImage decodes a PNG or JPEG file into dst as the model's input: c planes (1: grey by
// the standard library's BT.601 luma, 3: R, G, B) of h × w, resized bilinearly when the image
// has another size, rounded to bytes and normalised as the training batches are. data/ has
// the same conversion for image folders but does not export it, hence this small copy.
func loadImage(dst []float32, path string, c, h, w int, norm data.Normalize) error {
	if c != 1 && c != 3 {
		return fmt.Errorf("%s: the model takes %d input channels; images give 1 (grey) or 3 (RGB)", path, c)
	}
	f, err := os.Open(path)
	if err != nil {
		return fmt.Errorf("image: %w", err)
	}
	defer f.Close()
	img, _, err := image.Decode(bufio.NewReader(f))
	if err != nil {
		return fmt.Errorf("image %s: not a PNG or JPEG image: %w", path, err)
	}
	b := img.Bounds()
	if b.Empty() {
		return fmt.Errorf("image %s: empty", path)
	}
	src := make([]uint8, c*b.Dy()*b.Dx())
	for y := 0; y < b.Dy(); y++ {
		for x := 0; x < b.Dx(); x++ {
			px := img.At(b.Min.X+x, b.Min.Y+y)
			i := y*b.Dx() + x
			if c == 1 {
				src[i] = color.GrayModel.Convert(px).(color.Gray).Y
				continue
			}
			n := color.NRGBAModel.Convert(px).(color.NRGBA)
			plane := b.Dy() * b.Dx()
			src[i], src[plane+i], src[2*plane+i] = n.R, n.G, n.B
		}
	}
	pix := bilinear(src, c, b.Dy(), b.Dx(), h, w)
	for ch := 0; ch < c; ch++ {
		n := norm
		if ch < len(norm.PerChannel) {
			n = norm.PerChannel[ch]
		}
		mean, std := float64(n.Mean), float64(n.Std)
		for i, p := range pix[ch*h*w : (ch+1)*h*w] {
			dst[ch*h*w+i] = float32((float64(p)/255 - mean) / std) // as data's normalisation table
		}
	}
	return nil
}

// bilinear resamples c planes of sh × sw bytes to dh × dw, on pixel centres
// (align_corners=False, as PIL and torchvision), rounding to the nearest byte.
func bilinear(src []uint8, c, sh, sw, dh, dw int) []uint8 {
	if sh == dh && sw == dw {
		return src
	}
	axis := func(i int, scale float64, n int) (int, int, float64) {
		s := max((float64(i)+0.5)*scale-0.5, 0)
		lo := int(s)
		if lo >= n-1 {
			return n - 1, n - 1, 0
		}
		return lo, lo + 1, s - float64(lo)
	}
	dst := make([]uint8, c*dh*dw)
	sy, sx := float64(sh)/float64(dh), float64(sw)/float64(dw)
	for ch := 0; ch < c; ch++ {
		in, out := src[ch*sh*sw:][:sh*sw], dst[ch*dh*dw:][:dh*dw]
		for y := 0; y < dh; y++ {
			y0, y1, fy := axis(y, sy, sh)
			for x := 0; x < dw; x++ {
				x0, x1, fx := axis(x, sx, sw)
				top := float64(in[y0*sw+x0])*(1-fx) + float64(in[y0*sw+x1])*fx
				bot := float64(in[y1*sw+x0])*(1-fx) + float64(in[y1*sw+x1])*fx
				out[y*dw+x] = uint8(math.Min(255, math.Max(0, math.Round(top*(1-fy)+bot*fy))))
			}
		}
	}
	return dst
}
