package infer

import (
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"math"
	"slices"

	"github.com/qvd/qvd/data"
	"github.com/qvd/qvd/model"
)

// Prediction is one image's top-k classes, as qvd predict --json prints them.
type Prediction struct {
	Image string  `json:"image"`
	Top   []Class `json:"top"`
}

// Class is a class and its probability.
type Class struct {
	Class int     `json:"class"`
	Name  string  `json:"name"`
	Prob  float64 `json:"probability"`
}

// Predict classifies PNG or JPEG image files (a Model from LoadModel or Load): each image's
// topK most probable classes.
func (m *Model) Predict(images []string, topK int) ([]Prediction, error) {
	c, h, w := m.Spec.Input[0], m.Spec.Input[1], m.Spec.Input[2]
	x := make([]float32, len(images)*c*h*w)
	for i, path := range images {
		if err := loadImage(x[i*c*h*w:][:c*h*w], path, c, h, w, m.Norm); err != nil {
			return nil, err
		}
	}
	classes := m.Spec.Classes
	logits := make([]float32, len(images)*classes)
	if err := model.Forward(logits, m.Spec, m.Layout, m.Params, x, len(images)); err != nil {
		return nil, err
	}
	preds := make([]Prediction, len(images))
	for i, path := range images {
		top, err := model.TopK(logits[i*classes:(i+1)*classes], topK)
		if err != nil {
			return nil, err
		}
		preds[i].Image = path
		for _, r := range top {
			preds[i].Top = append(preds[i].Top, Class{Class: r.Class, Name: m.Names[r.Class], Prob: r.Prob})
		}
	}
	return preds, nil
}

// Print writes p as qvd predict does: the image, then one line per class; with asJSON one
// JSON line.
func (p Prediction) Print(w io.Writer, asJSON bool) error {
	if asJSON {
		return json.NewEncoder(w).Encode(p)
	}
	fmt.Fprintf(w, "%s\n", p.Image)
	for _, t := range p.Top {
		fmt.Fprintf(w, "  %6.4f  %d %s\n", t.Prob, t.Class, t.Name)
	}
	return nil
}

// ModelShape is the sample shape and class count the model takes, found without the
// dataset: model.input and model.classes where the config sets them, else what the
// checkpoint recorded of its training data (meta.json), else the weights' shapes — the
// classifier's outputs are the classes; the first layer's inputs give the sample, with
// data.channels and data.image_size where set, else the square image they fit (one channel
// or three for an MLP; for a CNN, the smallest side its pooling maps onto the first dense
// layer).
func (l *Loaded) ModelShape() (data.Shape, error) {
	m := l.Config.Model
	var s data.Shape
	if len(m.Input) == 3 {
		s.C, s.H, s.W = m.Input[0], m.Input[1], m.Input[2]
	} else if l.meta != nil && len(l.meta.Input) == 3 {
		s.C, s.H, s.W = l.meta.Input[0], l.meta.Input[1], l.meta.Input[2]
	}
	s.Classes = m.Classes
	if s.Classes == 0 && l.meta != nil {
		s.Classes = l.meta.Classes
	}
	dims := func(name string, rank int) ([]int, error) {
		info, err := l.file.Info(name)
		if err != nil {
			return nil, fmt.Errorf("%s: sizing the model from its weights: %w", l.weights, err)
		}
		if len(info.Shape) != rank || slices.Contains(info.Shape, 0) {
			return nil, fmt.Errorf("%s: tensor %s has shape %v, want %d non-zero dimensions (model.type %s)", l.weights, name, info.Shape, rank, m.Type)
		}
		return info.Shape, nil
	}
	if s.Classes == 0 {
		w, err := dims(fmt.Sprintf("fc%d.weight", len(m.Hidden)+1), 2) // the classifier, [out, in]
		if err != nil {
			return s, err
		}
		s.Classes = w[0]
	}
	if s.C > 0 {
		return s, nil
	}
	s.C = l.Config.Data.Channels
	if len(l.Config.Data.ImageSize) == 2 {
		s.H, s.W = l.Config.Data.ImageSize[0], l.Config.Data.ImageSize[1]
	}
	fc1, err := dims("fc1.weight", 2)
	if err != nil {
		return s, err
	}
	in := fc1[1]
	if m.Type == model.TypeCNN {
		conv1, err := dims("conv1.weight", 4)
		if err != nil {
			return s, err
		}
		if s.C == 0 {
			s.C = conv1[1]
		}
		if s.H == 0 {
			last, pools := m.Channels[len(m.Channels)-1], len(m.Channels)
			side, ok := isqrt(in / last)
			if in%last != 0 || !ok {
				return s, fmt.Errorf("%s: fc1 takes %d inputs, not %d channels of a square image: set model.input [C, H, W]", l.weights, in, last)
			}
			s.H, s.W = side<<pools, side<<pools
		}
		return s, nil
	}
	switch {
	case s.C > 0 && s.H > 0:
	case s.H > 0:
		s.C = in / (s.H * s.W)
	case s.C > 0:
		side, ok := isqrt(in / s.C)
		if in%s.C != 0 || !ok {
			return s, fmt.Errorf("%s: fc1 takes %d inputs, not a square image of %d channels: set model.input [C, H, W]", l.weights, in, s.C)
		}
		s.H, s.W = side, side
	default:
		if side, ok := isqrt(in); ok {
			s.C, s.H, s.W = 1, side, side
		} else if side, ok := isqrt(in / 3); ok && in%3 == 0 {
			s.C, s.H, s.W = 3, side, side
		} else {
			return s, fmt.Errorf("%s: fc1 takes %d inputs, not a square grey or RGB image: set model.input [C, H, W]", l.weights, in)
		}
	}
	if s.C*s.H*s.W != in {
		return s, fmt.Errorf("%s: fc1 takes %d inputs, but data.channels and data.image_size give %d×%d×%d: set model.input [C, H, W]", l.weights, in, s.C, s.H, s.W)
	}
	return s, nil
}

// isqrt is n's integer square root and whether n is its square.
func isqrt(n int) (int, bool) {
	if n < 1 {
		return 0, false
	}
	r := int(math.Sqrt(float64(n)))
	for r*r > n {
		r--
	}
	for (r+1)*(r+1) <= n {
		r++
	}
	return r, r*r == n
}

// loadImage decodes a PNG or JPEG file into dst as the model's input, with image folders'
// conversion (data.ReadImage: c planes of h × w, resized bilinearly), normalised as the
// training batches are.
func loadImage(dst []float32, path string, c, h, w int, norm data.Normalize) error {
	if c != 1 && c != 3 {
		return fmt.Errorf("%s: the model takes %d input channels; images give 1 (grey) or 3 (RGB)", path, c)
	}
	pix := make([]uint8, c*h*w)
	if err := data.ReadImage(pix, path, c, h, w); err != nil {
		if errors.Is(err, data.ErrBadData) {
			return fmt.Errorf("image %s: not a PNG or JPEG image: %w", path, err)
		}
		return fmt.Errorf("image: %w", err)
	}
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
