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
// PyTorch's Conv2d; Flatten keeps the [C, H, W] order, as torch.flatten does. The layers run
// in evaluation mode (Dropout is the identity, BatchNorm2d normalises with the running
// statistics); normalisation statistics, GELU, attention and pooling are computed in float64.
// It allocates its scratch buffers per call.
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
	var skips [][]float32 // the inputs of the open residual branches
	tensor := func(ti int) []float32 {
		t := l.Tensors[ti]
		return flat[t.Offset : t.Offset+t.Size]
	}
	for _, ly := range s.Layers {
		outSize := prod(ly.OutShape)
		switch ly.Kind {
		case Dense:
			w, b := l.Tensors[ly.Weight], l.Tensors[ly.Bias]
			rows := n * ly.Rows() // a sequence's tokens are rows
			out := make([]float32, rows*ly.Out)
			for r := 0; r < rows; r++ {
				copy(out[r*ly.Out:(r+1)*ly.Out], flat[b.Offset:b.Offset+b.Size])
			}
			// The flat buffer holds a Linear weight transposed, [in, out]: out = h·W + b.
			impl.Sgemm(blas.NoTrans, blas.NoTrans, rows, ly.Out, ly.In, 1, h, ly.In, flat[w.Offset:w.Offset+w.Size], ly.Out, 1, out, ly.Out)
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
		case Flatten, Dropout: // dropout is the identity in evaluation
		case Residual:
			skips = append(skips, append([]float32(nil), h...))
		case Add:
			if len(skips) == 0 {
				return fmt.Errorf("model: forward: add without its residual")
			}
			skip := skips[len(skips)-1]
			skips = skips[:len(skips)-1]
			for i := range h {
				h[i] += skip[i]
			}
		case LayerNorm:
			layerNorm(h, n*ly.Rows(), ly.Out, tensor(ly.Weight), tensor(ly.Bias), ly.Eps)
		case GELU:
			for i, v := range h {
				h[i] = float32(float64(v) * 0.5 * (1 + math.Erf(float64(v)/math.Sqrt2)))
			}
		case BatchNorm2d:
			batchNormEval(h, n, ly, tensor(ly.Weight), tensor(ly.Bias), tensor(ly.RunMean), tensor(ly.RunVar))
		case PatchEmbed:
			h = patchEmbed(h, n, ly, tensor(ly.Weight), tensor(ly.Bias))
		case Tokens:
			t, d := ly.InShape[0], ly.InShape[1]
			cls, pos := tensor(ly.Weight), tensor(ly.Bias)
			out := make([]float32, n*(t+1)*d)
			for s := 0; s < n; s++ {
				o := out[s*(t+1)*d:][:(t+1)*d]
				copy(o, cls)
				copy(o[d:], h[s*t*d:][:t*d])
				for i := range o {
					o[i] += pos[i]
				}
			}
			h = out
		case Attention:
			h = attention(h, n, ly)
		case ClassPool:
			t, d := ly.InShape[0], ly.InShape[1]
			out := make([]float32, n*d)
			for s := 0; s < n; s++ {
				copy(out[s*d:][:d], h[s*t*d:][:d])
			}
			h = out
		case MeanPool:
			h = meanPool(h, n, ly)
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

// layerNorm normalises each of the rows of x (rows × cols) in place over its cols elements
// (biased variance, statistics in float64), then scales by gamma and shifts by beta.
func layerNorm(x []float32, rows, cols int, gamma, beta []float32, eps float32) {
	for r := 0; r < rows; r++ {
		row := x[r*cols:][:cols]
		var mean, vari float64
		for _, v := range row {
			mean += float64(v)
		}
		mean /= float64(cols)
		for _, v := range row {
			d := float64(v) - mean
			vari += d * d
		}
		vari /= float64(cols)
		rstd := 1 / math.Sqrt(vari+float64(eps))
		for c, v := range row {
			row[c] = float32((float64(v)-mean)*rstd*float64(gamma[c]) + float64(beta[c]))
		}
	}
}

// batchNormEval is BatchNorm2d in evaluation: each channel normalised in place with the
// running statistics.
func batchNormEval(x []float32, n int, ly Layer, gamma, beta, runMean, runVar []float32) {
	c, hw := ly.InShape[0], ly.InShape[1]*ly.InShape[2]
	for s := 0; s < n; s++ {
		for ch := 0; ch < c; ch++ {
			rstd := 1 / math.Sqrt(float64(runVar[ch])+float64(ly.Eps))
			p := x[(s*c+ch)*hw:][:hw]
			for i, v := range p {
				p[i] = float32((float64(v)-float64(runMean[ch]))*rstd*float64(gamma[ch]) + float64(beta[ch]))
			}
		}
	}
}

// patchEmbed is a stride-p, p×p convolution to ly.Out features, its output as tokens [T, D]
// with the patches in raster order.
func patchEmbed(x []float32, n int, ly Layer, w, b []float32) []float32 {
	c, hh, ww, p := ly.InShape[0], ly.InShape[1], ly.InShape[2], ly.Patch
	gw := ww / p
	t, d := ly.OutShape[0], ly.Out
	out := make([]float32, n*t*d)
	for s := 0; s < n; s++ {
		xs := x[s*c*hh*ww:]
		for tok := 0; tok < t; tok++ {
			py, px := tok/gw, tok%gw
			for o := 0; o < d; o++ {
				sum := float64(b[o])
				for ci := 0; ci < c; ci++ {
					for ky := 0; ky < p; ky++ {
						for kx := 0; kx < p; kx++ {
							sum += float64(w[((o*c+ci)*p+ky)*p+kx]) * float64(xs[(ci*hh+py*p+ky)*ww+px*p+kx])
						}
					}
				}
				out[(s*t+tok)*d+o] = float32(sum)
			}
		}
	}
	return out
}

// attention is multi-head self-attention on x = [Q K V] (n × T × 3D): per head,
// softmax(Q·Kᵀ/√dh)·V, the heads side by side (n × T × D); in float64.
func attention(x []float32, n int, ly Layer) []float32 {
	t, d, heads := ly.InShape[0], ly.Out, ly.Heads
	dh := d / heads
	scale := 1 / math.Sqrt(float64(dh))
	out := make([]float32, n*t*d)
	p := make([]float64, t)
	for s := 0; s < n; s++ {
		xs := x[s*t*3*d:]
		for hd := 0; hd < heads; hd++ {
			for i := 0; i < t; i++ {
				m := math.Inf(-1)
				for j := 0; j < t; j++ {
					var dot float64
					for k := 0; k < dh; k++ {
						dot += float64(xs[i*3*d+hd*dh+k]) * float64(xs[j*3*d+d+hd*dh+k])
					}
					p[j] = dot * scale
					m = max(m, p[j])
				}
				var sum float64
				for j := range p {
					p[j] = math.Exp(p[j] - m)
					sum += p[j]
				}
				for k := 0; k < dh; k++ {
					var acc float64
					for j := 0; j < t; j++ {
						acc += p[j] * float64(xs[j*3*d+2*d+hd*dh+k])
					}
					out[(s*t+i)*d+hd*dh+k] = float32(acc / sum)
				}
			}
		}
	}
	return out
}

// meanPool averages an image's planes ([C, H, W] → [C]) or a sequence's tokens ([T, D] →
// [D]).
func meanPool(x []float32, n int, ly Layer) []float32 {
	if len(ly.InShape) == 3 {
		c, hw := ly.InShape[0], ly.InShape[1]*ly.InShape[2]
		out := make([]float32, n*c)
		for i := range out {
			var sum float64
			for _, v := range x[i*hw:][:hw] {
				sum += float64(v)
			}
			out[i] = float32(sum / float64(hw))
		}
		return out
	}
	t, d := ly.InShape[0], ly.InShape[1]
	out := make([]float32, n*d)
	for s := 0; s < n; s++ {
		for c := 0; c < d; c++ {
			var sum float64
			for tok := 0; tok < t; tok++ {
				sum += float64(x[(s*t+tok)*d+c])
			}
			out[s*d+c] = float32(sum / float64(t))
		}
	}
	return out
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
