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
	// Buffer marks state that is saved with the parameters but is not one (a BatchNorm2d's
	// running statistics): always frozen, updated by the forward pass itself.
	Buffer bool
}

// tensorSlot says which of a Layer's tensor indices a tensor fills.
type tensorSlot uint8

const (
	slotWeight tensorSlot = iota
	slotBias
	slotRunMean
	slotRunVar
)

type tensorEntry struct {
	name       string
	shape      []int
	transposed bool
	buffer     bool
	slot       tensorSlot
}

// layerTensors lists layer l's tensors with their canonical (PyTorch) names and shapes.
func layerTensors(l Layer) []tensorEntry {
	w, b := l.Name+".weight", l.Name+".bias"
	switch l.Kind {
	case Dense:
		return []tensorEntry{{name: w, shape: []int{l.Out, l.In}, transposed: true}, {name: b, shape: []int{l.Out}, slot: slotBias}}
	case Conv2D, PatchEmbed:
		return []tensorEntry{{name: w, shape: []int{l.Out, l.In, l.Kernel, l.Kernel}}, {name: b, shape: []int{l.Out}, slot: slotBias}}
	case LayerNorm:
		return []tensorEntry{{name: w, shape: []int{l.Out}}, {name: b, shape: []int{l.Out}, slot: slotBias}}
	case BatchNorm2d:
		return []tensorEntry{{name: w, shape: []int{l.Out}}, {name: b, shape: []int{l.Out}, slot: slotBias},
			{name: l.Name + ".running_mean", shape: []int{l.Out}, buffer: true, slot: slotRunMean},
			{name: l.Name + ".running_var", shape: []int{l.Out}, buffer: true, slot: slotRunVar}}
	case Tokens:
		prefix := ""
		if l.Name != "" {
			prefix = l.Name + "."
		}
		return []tensorEntry{{name: prefix + "cls_token", shape: []int{1, 1, l.Out}},
			{name: prefix + "pos_embed", shape: []int{1, l.OutShape[0], l.Out}, slot: slotBias}}
	}
	return nil
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
		tensorEntry
		layer int
	}
	var all []entry
	for i := range s.Layers {
		for _, t := range layerTensors(s.Layers[i]) {
			all = append(all, entry{t, i})
		}
	}
	l := &Layout{byName: map[string]int{}}
	align := func(n int) int { return (n + Align - 1) / Align * Align }
	for _, pass := range []bool{true, false} {
		for _, e := range all {
			if (e.buffer || (frozen != nil && frozen(e.name))) != pass {
				continue
			}
			size := prod(e.shape)
			off := align(l.Size)
			l.Tensors = append(l.Tensors, Tensor{Name: e.name, Shape: e.shape, Offset: off, Size: size, Layer: e.layer, Transposed: e.transposed, Frozen: pass, Buffer: e.buffer})
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
		ly.Weight, ly.Bias, ly.RunMean, ly.RunVar = -1, -1, -1, -1
		for _, t := range layerTensors(*ly) {
			idx := l.byName[t.name]
			switch t.slot {
			case slotWeight:
				ly.Weight = idx
			case slotBias:
				ly.Bias = idx
			case slotRunMean:
				ly.RunMean = idx
			case slotRunVar:
				ly.RunVar = idx
			}
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
	for ti, t := range l.Tensors {
		ly := s.Layers[t.Layer]
		x := flat[t.Offset : t.Offset+t.Size]
		switch {
		case ly.Kind == LayerNorm || ly.Kind == BatchNorm2d:
			if ti == ly.Weight || ti == ly.RunVar {
				for i := range x {
					x[i] = 1 // scale 1, shift 0; running variance 1, mean 0 (PyTorch's)
				}
			}
		case ly.Kind == Tokens:
			// Class token and position embeddings: N(0, 0.02²) truncated at 2σ (timm's).
			for i := range x {
				v := rng.NormFloat64()
				for math.Abs(v) > 2 {
					v = rng.NormFloat64()
				}
				x[i] = float32(0.02 * v)
			}
		case ti == ly.Weight:
			fanIn := ly.In
			if ly.Kind == Conv2D || ly.Kind == PatchEmbed {
				fanIn = ly.In * ly.Kernel * ly.Kernel
			}
			bound := math.Sqrt(6 / float64(fanIn))
			for i := range x {
				x[i] = float32((rng.Float64()*2 - 1) * bound)
			}
		}
	}
}
