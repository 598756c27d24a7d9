package main

import (
	"encoding/json"
	"image"
	"image/color"
	"image/jpeg"
	"image/png"
	"math"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/qvd/qvd/infer"
	"github.com/qvd/qvd/model"
)

// writeImage writes the grey pixels of test sample i (h × w), scaled up by an integer factor
// (nearest neighbour), as a PNG or JPEG.
func writeImage(t *testing.T, path string, pix []uint8, h, w, scale int, asJPEG bool) {
	t.Helper()
	img := image.NewGray(image.Rect(0, 0, w*scale, h*scale))
	for y := 0; y < h*scale; y++ {
		for x := 0; x < w*scale; x++ {
			img.SetGray(x, y, color.Gray{Y: pix[(y/scale)*w+x/scale]})
		}
	}
	f, err := os.Create(path)
	if err != nil {
		t.Fatal(err)
	}
	if asJPEG {
		err = jpeg.Encode(f, img, &jpeg.Options{Quality: 95})
	} else {
		err = png.Encode(f, img)
	}
	if cerr := f.Close(); err == nil {
		err = cerr
	}
	if err != nil {
		t.Fatal(err)
	}
}

// TestPredict: a PNG of a test image predicts what the evaluation's forward pass gives that
// sample, with the same softmax probabilities; a 2× upscaled PNG and a JPEG are read too.
func TestPredict(t *testing.T) {
	run, _, _ := trainShort(t, "fashion-mlp", 40, 100)
	logits, inf := goLogits(t, "fashion-mlp", run, 100)
	ds := inf.Test
	dir := t.TempDir()
	var paths []string
	for i := 0; i < 3; i++ {
		p := filepath.Join(dir, "sample"+string(rune('0'+i))+".png")
		writeImage(t, p, ds.Images[i*784:(i+1)*784], 28, 28, 1, false)
		paths = append(paths, p)
	}
	big := filepath.Join(dir, "big.png")
	writeImage(t, big, ds.Images[:784], 28, 28, 2, false)
	jpg := filepath.Join(dir, "sample0.jpg")
	writeImage(t, jpg, ds.Images[:784], 28, 28, 1, true)

	args := append([]string{"predict", "-c", "fashion-mlp", "--checkpoint", run, "--json", "--top-k", "3"}, append(paths, big, jpg)...)
	code, stdout, stderr := runQVD(t, args...)
	if code != exitOK {
		t.Fatalf("exit %d\n%s\n%s", code, stdout, stderr)
	}
	lines := strings.Split(strings.TrimSpace(stdout), "\n")
	if len(lines) != 5 {
		t.Fatalf("%d lines, want 5:\n%s", len(lines), stdout)
	}
	var preds []infer.Prediction
	for _, l := range lines {
		var p infer.Prediction
		if err := json.Unmarshal([]byte(l), &p); err != nil {
			t.Fatalf("%q: %v", l, err)
		}
		if len(p.Top) != 3 || p.Top[0].Prob < p.Top[1].Prob || p.Top[1].Prob < p.Top[2].Prob {
			t.Fatalf("top-3 not in decreasing probability: %+v", p)
		}
		preds = append(preds, p)
	}
	for i := 0; i < 3; i++ {
		want, err := model.TopK(logits[i*10:(i+1)*10], 3)
		if err != nil {
			t.Fatal(err)
		}
		for k, w := range want {
			got := preds[i].Top[k]
			if got.Class != w.Class || math.Abs(got.Prob-w.Prob) > 1e-6 || got.Name != infer.FashionMNISTClasses[w.Class] {
				t.Errorf("%s: rank %d is %+v, the evaluation forward gives class %d (%s) with %.6f", preds[i].Image, k, got, w.Class, infer.FashionMNISTClasses[w.Class], w.Prob)
			}
		}
	}
	// The upscaled copy resizes back to nearly the same pixels, the JPEG nearly decodes to them.
	for _, p := range preds[3:] {
		if p.Top[0].Class != preds[0].Top[0].Class {
			t.Errorf("%s predicts %+v, the original %+v", p.Image, p.Top[0], preds[0].Top[0])
		}
	}
	// The text output names the image and its classes; flags may follow the images.
	code, stdout, _ = runQVD(t, "predict", "-c", "fashion-mlp", paths[0], "--checkpoint", run, "--top-k", "2")
	if code != exitOK || !strings.HasPrefix(stdout, paths[0]+"\n") || strings.Count(stdout, "\n") != 3 || !strings.Contains(stdout, preds[0].Top[0].Name) {
		t.Errorf("text output (exit %d):\n%s", code, stdout)
	}
}

// TestPredictBadInput: an unreadable or missing image, no image and a bad --top-k are errors
// naming the problem, with a non-zero exit.
func TestPredictBadInput(t *testing.T) {
	run, _, _ := trainShort(t, "fashion-mlp", 5, 100)
	dir := t.TempDir()
	notImage := filepath.Join(dir, "notes.png")
	os.WriteFile(notImage, []byte("hello"), 0o644)
	missing := filepath.Join(dir, "missing.png")
	cases := []struct {
		name string
		args []string
		code int
		want []string
	}{
		{"not an image", []string{"predict", "--checkpoint", run, notImage}, exitFailure, []string{notImage, "not a PNG or JPEG"}},
		{"missing image", []string{"predict", "--checkpoint", run, missing}, exitFailure, []string{missing, "no such file"}},
		{"no image", []string{"predict", "--checkpoint", run}, exitUsage, []string{"give one or more"}},
		{"top-k 0", []string{"predict", "--checkpoint", run, "--top-k", "0", notImage}, exitUsage, []string{"--top-k must be >= 1"}},
		{"missing checkpoint", []string{"predict", "--checkpoint", filepath.Join(dir, "nockpt"), notImage}, exitFailure, []string{"nockpt"}},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			code, stdout, stderr := runQVD(t, c.args...)
			if code != c.code {
				t.Fatalf("exit %d, want %d\nstdout: %s\nstderr: %s", code, c.code, stdout, stderr)
			}
			for _, w := range c.want {
				if !strings.Contains(stderr, w) {
					t.Errorf("stderr does not contain %q:\n%s", w, stderr)
				}
			}
		})
	}
}
