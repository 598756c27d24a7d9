package model

import (
	"errors"
	"fmt"
	"math"
	"sort"

	"gonum.org/v1/gonum/blas"
	"gonum.org/v1/gonum/blas/gonum"
)

// Forward computes the logits of n samples x (n × prod(s.Input) values, [C, H, W] row-major
// per sample) into dst (n × s.Classes) with the weights in flat (laid out by l): a plain-Go
// forward pass on the host, independent of the training engines, for `qvd eval` and
// `qvd predict`. Convolutions are cross-correlations over [out, in, kH, kW] weights, as in
// PyTorch's Conv2d; Flatten keeps the [C, H, W] order, as torch.flatten does. It allocates its
// scratch buffers per call.
func Forward(dst []float32, s *Spec, l *Layout, flat, x []float32, n int) error {
	in := prod(s.Input)
	switch {
	case len(flat) != l.Size:
		return fmt.Errorf("model: forward: flat has %d elements, the layout needs %d", len(flat), l.Size)
	case n < 0 || len(x) < n*in:
		return fmt.Errorf("model: forward: %d samples of %d values need %d inputs, got %d", n, in, n*in, len(x))
	case len(dst) < n*s.Classes:
		return fmt.Errorf("model: forward: %d samples of %d classes need %d outputs, got %d", n, s.Classes, n*s.Classes, len(dst))
	}
	if n == 0 {
		return nil
	}
	impl := gonum.Implementation{}
	h := append([]float32(nil), x[:n*in]...)
	for _, ly := range s.Layers {
		outSize := prod(ly.OutShape)
		switch ly.Kind {
		case Dense:
			w, b := l.Tensors[ly.Weight], l.Tensors[ly.Bias]
			out := make([]float32, n*ly.Out)
			for r := 0; r < n; r++ {
				copy(out[r*ly.Out:(r+1)*ly.Out], flat[b.Offset:b.Offset+b.Size])
			}
			// The flat buffer holds a Linear weight transposed, [in, out]: out = h·W + b.
			impl.Sgemm(blas.NoTrans, blas.NoTrans, n, ly.Out, ly.In, 1, h, ly.In, flat[w.Offset:w.Offset+w.Size], ly.Out, 1, out, ly.Out)
			h = out
		case Conv2D:
			h = conv2d(impl, h, n, ly, flat[l.Tensors[ly.Weight].Offset:], flat[l.Tensors[ly.Bias].Offset:])
		case ReLU:
			for i, v := range h {
				if v < 0 {
					h[i] = 0
				}
			}
		case MaxPool2:
			h = maxPool2(h, n, ly.InShape, ly.OutShape)
		case Flatten:
		default:
			return fmt.Errorf("model: forward: layer kind %v not supported", ly.Kind)
		}
		if len(h) != n*outSize {
			return fmt.Errorf("model: forward: layer %s (%v) produced %d values, want %d", ly.Name, ly.Kind, len(h), n*outSize)
		}
	}
	copy(dst, h)
	return nil
}

// conv2d is a stride-1 convolution with ly.Pad zero padding, by im2col and one GEMM per
// sample: out[o, p] = Σ_k W[o, k] · col[k, p] + b[o].
func conv2d(impl gonum.Implementation, x []float32, n int, ly Layer, w, b []float32) []float32 {
	c, hh, ww := ly.InShape[0], ly.InShape[1], ly.InShape[2]
	oh, ow := ly.OutShape[1], ly.OutShape[2]
	k, pad := ly.Kernel, ly.Pad
	kk := c * k * k
	col := make([]float32, kk*oh*ow)
	out := make([]float32, n*ly.Out*oh*ow)
	for s := 0; s < n; s++ {
		xs := x[s*c*hh*ww:]
		for ci := 0; ci < c; ci++ {
			for ky := 0; ky < k; ky++ {
				for kx := 0; kx < k; kx++ {
					row := col[((ci*k+ky)*k+kx)*oh*ow:][:oh*ow]
					for oy := 0; oy < oh; oy++ {
						iy := oy + ky - pad
						for ox := 0; ox < ow; ox++ {
							ix := ox + kx - pad
							v := float32(0)
							if iy >= 0 && iy < hh && ix >= 0 && ix < ww {
								v = xs[(ci*hh+iy)*ww+ix]
							}
							row[oy*ow+ox] = v
						}
					}
				}
			}
		}
		ys := out[s*ly.Out*oh*ow:][:ly.Out*oh*ow]
		for o := 0; o < ly.Out; o++ {
			for p := range oh * ow {
				ys[o*oh*ow+p] = b[o]
			}
		}
		impl.Sgemm(blas.NoTrans, blas.NoTrans, ly.Out, oh*ow, kk, 1, w, kk, col, oh*ow, 1, ys, oh*ow)
	}
	return out
}

// maxPool2 is a 2×2 max-pool with stride 2 (odd trailing rows and columns dropped).
func maxPool2(x []float32, n int, in, out []int) []float32 {
	c, hh, ww := in[0], in[1], in[2]
	oh, ow := out[1], out[2]
	y := make([]float32, n*c*oh*ow)
	for p := 0; p < n*c; p++ {
		xs, ys := x[p*hh*ww:], y[p*oh*ow:]
		for oy := 0; oy < oh; oy++ {
			for ox := 0; ox < ow; ox++ {
				i := 2*oy*ww + 2*ox
				ys[oy*ow+ox] = max(xs[i], xs[i+1], xs[i+ww], xs[i+ww+1])
			}
		}
	}
	return y
}

// Confusion counts predictions against labels: Counts[label*Classes+predicted].
type Confusion struct {
	Classes int
	Counts  []int
	LossSum float64 // summed cross-entropy, as Score computes it
}

// NewConfusion is an empty confusion matrix over classes.
func NewConfusion(classes int) *Confusion {
	return &Confusion{Classes: classes, Counts: make([]int, classes*classes)}
}

// Add scores n samples' logits (n × Classes) against their labels.
func (c *Confusion) Add(logits []float32, labels []int32, n int) error {
	res, err := Score(logits, labels, n, c.Classes)
	if err != nil {
		return err
	}
	c.LossSum += res.LossSum
	for i := 0; i < n; i++ {
		c.Counts[int(labels[i])*c.Classes+Argmax(logits[i*c.Classes:(i+1)*c.Classes])]++
	}
	return nil
}

// N is the number of samples counted.
func (c *Confusion) N() int {
	t := 0
	for _, v := range c.Counts {
		t += v
	}
	return t
}

// Correct is the number of samples predicted right (the diagonal).
func (c *Confusion) Correct() int {
	t := 0
	for i := 0; i < c.Classes; i++ {
		t += c.Counts[i*c.Classes+i]
	}
	return t
}

// Accuracy is Correct/N (0 with no samples).
func (c *Confusion) Accuracy() float64 {
	if c.N() == 0 {
		return 0
	}
	return float64(c.Correct()) / float64(c.N())
}

// Loss is the mean cross-entropy (0 with no samples).
func (c *Confusion) Loss() float64 {
	if c.N() == 0 {
		return 0
	}
	return c.LossSum / float64(c.N())
}

// Argmax is the index of the largest value (the first of ties), as Score counts a hit.
func Argmax(row []float32) int {
	best := 0
	for i, v := range row {
		if v > row[best] {
			best = i
		}
	}
	return best
}

// Ranked is one class with its softmax probability.
type Ranked struct {
	Class int
	Prob  float64
}

// TopK returns the k most probable classes of one row of logits, most probable first, with
// their softmax probabilities (computed in float64, shifted by the maximum).
func TopK(logits []float32, k int) ([]Ranked, error) {
	if len(logits) == 0 {
		return nil, errors.New("model: top-k of no logits")
	}
	if k < 1 {
		return nil, fmt.Errorf("model: top-k: k must be >= 1, got %d", k)
	}
	m := logits[Argmax(logits)]
	var sum float64
	all := make([]Ranked, len(logits))
	for i, v := range logits {
		e := math.Exp(float64(v - m))
		all[i] = Ranked{Class: i, Prob: e}
		sum += e
	}
	for i := range all {
		all[i].Prob /= sum
	}
	sort.SliceStable(all, func(a, b int) bool { return all[a].Prob > all[b].Prob })
	return all[:min(k, len(all))], nil
}
