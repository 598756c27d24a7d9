package model

import (
	"fmt"
	"math"
	"math/rand/v2"
)

// Align is the element alignment of every tensor's offset in the flat buffer: 16 float32 =
// 64 bytes, one cache line and a whole number of AVX-512 vectors, so vector loops over a
// tensor never straddle a line at its start. Padding elements are zero and stay zero (their
// gradient is zero and every optimizer maps a zero parameter with zero gradient to zero).
const Align = 16

// Tensor is one named parameter tensor inside the flat buffer.
type Tensor struct {
	Name string
	// Shape is the tensor's canonical (PyTorch) shape: Linear weights are [out, in], conv
	// weights [out, in, kH, kW], biases [out]. Checkpoints are written in this shape.
	Shape []int
	// Offset and Size locate it in the flat buffer: flat[Offset : Offset+Size].
	Offset, Size int
	// Layer is the index in Spec.Layers of the layer that owns it.
	Layer int
	// Transposed means the flat buffer holds the 2-D transpose of Shape ([in, out] for a
	// Linear weight, which is what x·W needs); Canonical/SetCanonical convert.
	Transposed bool
	// Frozen tensors are not trained: they sit in the prefix [0, Layout.Frozen) of the flat
	// buffer, get no gradient, no optimizer state and no communication.
	Frozen bool
}

// Layout is the arrangement of all trainable tensors in one flat []float32.
type Layout struct {
	Tensors []Tensor
	Size    int // flat length including alignment padding
	// Frozen is the length of the frozen prefix: the trainable tensors are flat[Frozen:Size],
	// which is all the gradient buffers, the optimizer and ZeRO's partition cover.
	Frozen int
	byName map[string]int
}

// Trainable is the number of flat elements past the frozen prefix.
func (l *Layout) Trainable() int { return l.Size - l.Frozen }

// NewLayout assigns every parameter tensor of s an aligned offset, in layer order (weight then
// bias), and records the tensor indices in s.Layers.
func NewLayout(s *Spec) *Layout { return NewLayoutFrozen(s, nil) }

// NewLayoutFrozen is NewLayout with the tensors frozen(name) says placed first, in layer
// order, then the trainable ones, so the trainable part is one contiguous, aligned suffix
// [Frozen, Size) — what the gradient buffers, the optimizer and ZeRO's shards cover.
func NewLayoutFrozen(s *Spec, frozen func(name string) bool) *Layout {
	type entry struct {
		layer      int
		name       string
		shape      []int
		transposed bool
	}
	var all []entry
	for i := range s.Layers {
		ly := &s.Layers[i]
		switch ly.Kind {
		case Dense:
			all = append(all, entry{i, ly.Name + ".weight", []int{ly.Out, ly.In}, true}, entry{i, ly.Name + ".bias", []int{ly.Out}, false})
		case Conv2D:
			all = append(all, entry{i, ly.Name + ".weight", []int{ly.Out, ly.In, ly.Kernel, ly.Kernel}, false}, entry{i, ly.Name + ".bias", []int{ly.Out}, false})
		}
	}
	l := &Layout{byName: map[string]int{}}
	align := func(n int) int { return (n + Align - 1) / Align * Align }
	for _, pass := range []bool{true, false} {
		for _, e := range all {
			if (frozen != nil && frozen(e.name)) != pass {
				continue
			}
			size := prod(e.shape)
			off := align(l.Size)
			l.Tensors = append(l.Tensors, Tensor{Name: e.name, Shape: e.shape, Offset: off, Size: size, Layer: e.layer, Transposed: e.transposed, Frozen: pass})
			l.Size = off + size
			l.byName[e.name] = len(l.Tensors) - 1
		}
		if pass {
			l.Frozen = align(l.Size)
			l.Size = l.Frozen
		}
	}
	l.Size = align(l.Size)
	for i := range s.Layers {
		ly := &s.Layers[i]
		if ly.Kind == Dense || ly.Kind == Conv2D {
			ly.Weight, ly.Bias = l.byName[ly.Name+".weight"], l.byName[ly.Name+".bias"]
		}
	}
	return l
}

// Lookup returns the tensor with the given name.
func (l *Layout) Lookup(name string) (Tensor, bool) {
	i, ok := l.byName[name]
	if !ok {
		return Tensor{}, false
	}
	return l.Tensors[i], true
}

// NumParams is the number of real parameters (the flat size without padding).
func (l *Layout) NumParams() int {
	n := 0
	for _, t := range l.Tensors {
		n += t.Size
	}
	return n
}

// Canonical copies tensor t out of flat into dst (len t.Size) in its canonical shape.
func (l *Layout) Canonical(dst, flat []float32, t Tensor) {
	src := flat[t.Offset : t.Offset+t.Size]
	if !t.Transposed {
		copy(dst, src)
		return
	}
	rows, cols := t.Shape[0], t.Shape[1] // canonical [out, in]; flat holds [in, out]
	for r := 0; r < rows; r++ {
		for c := 0; c < cols; c++ {
			dst[r*cols+c] = src[c*rows+r]
		}
	}
}

// CanonicalAt writes elements [off, off+len(dst)) of tensor t, in its canonical shape, from
// flat into dst: Canonical a piece at a time, for writers that stream a tensor.
func (l *Layout) CanonicalAt(dst, flat []float32, t Tensor, off int) {
	src := flat[t.Offset : t.Offset+t.Size]
	if !t.Transposed {
		copy(dst, src[off:])
		return
	}
	rows := t.Shape[0] // canonical [out, in]; flat holds [in, out]
	cols := t.Shape[1]
	r, c := off/cols, off%cols
	for i := range dst {
		dst[i] = src[c*rows+r]
		if c++; c == cols {
			r, c = r+1, 0
		}
	}
}

// SetCanonical copies src, in t's canonical shape, into flat.
func (l *Layout) SetCanonical(flat, src []float32, t Tensor) {
	dst := flat[t.Offset : t.Offset+t.Size]
	if !t.Transposed {
		copy(dst, src)
		return
	}
	rows, cols := t.Shape[0], t.Shape[1]
	for r := 0; r < rows; r++ {
		for c := 0; c < cols; c++ {
			dst[c*rows+r] = src[r*cols+c]
		}
	}
}

// Describe returns a one-line description of each tensor, for logs.
func (l *Layout) Describe() []string {
	out := make([]string, len(l.Tensors))
	for i, t := range l.Tensors {
		out[i] = fmt.Sprintf("%s %v @%d", t.Name, t.Shape, t.Offset)
	}
	return out
}

// Init fills flat with a deterministic initialisation from seed: weights from He (Kaiming)
// uniform U(-√(6/fan_in), √(6/fan_in)), suited to ReLU networks (He et al. 2015), biases zero,
// padding zero. The same seed gives the same bits on every machine and rank.
func Init(s *Spec, l *Layout, flat []float32, seed uint64) {
	if len(flat) != l.Size {
		panic(fmt.Sprintf("model: Init: flat has %d elements, layout needs %d", len(flat), l.Size))
	}
	clear(flat)
	// A stream of its own (the second PCG word), so data shuffling from the same seed is independent.
	rng := rand.New(rand.NewPCG(seed, 0x9e3779b97f4a7c15))
	for _, t := range l.Tensors {
		ly := s.Layers[t.Layer]
		if t.Name != ly.Name+".weight" {
			continue
		}
		fanIn := ly.In
		if ly.Kind == Conv2D {
			fanIn = ly.In * ly.Kernel * ly.Kernel
		}
		bound := math.Sqrt(6 / float64(fanIn))
		w := flat[t.Offset : t.Offset+t.Size]
		for i := range w {
			w[i] = float32((rng.Float64()*2 - 1) * bound)
		}
	}
}
