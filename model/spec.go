package model

import (
	"fmt"
	"slices"
)

// LayerKind is the operation a Layer performs.
type LayerKind uint8

// Layer kinds. Dense and Conv2D hold parameters; the others do not.
const (
	Dense LayerKind = iota + 1
	Conv2D
	ReLU
	MaxPool2 // 2×2 max-pool, stride 2, no padding
	Flatten
)

func (k LayerKind) String() string {
	switch k {
	case Dense:
		return "dense"
	case Conv2D:
		return "conv2d"
	case ReLU:
		return "relu"
	case MaxPool2:
		return "maxpool2"
	case Flatten:
		return "flatten"
	}
	return fmt.Sprintf("LayerKind(%d)", uint8(k))
}

// Layer is one step of a sequential network. Shapes are per sample (no batch dimension):
// [features] after a Flatten or Dense, [channels, height, width] before.
type Layer struct {
	Kind     LayerKind
	Name     string // "fc1", "conv2", ...: the prefix of its tensors' names ("fc1.weight")
	In, Out  int    // Dense: features; Conv2D: channels
	Kernel   int    // Conv2D: square kernel size
	Pad      int    // Conv2D: padding on every side
	InShape  []int
	OutShape []int
	Weight   int // index of the weight tensor in the Layout, -1 if none
	Bias     int // index of the bias tensor in the Layout, -1 if none
}

// Spec is a sequential network: an input shape, its layers and the number of classes.
type Spec struct {
	Input   []int // per-sample input shape [C, H, W]
	Classes int
	Layers  []Layer
}

// NewSpec expands a Config into layers with inferred shapes, for inputs of shape [C, H, W]
// and the given number of classes.
func NewSpec(cfg Config, input []int, classes int) (*Spec, error) {
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	if len(input) != 3 || input[0] < 1 || input[1] < 1 || input[2] < 1 {
		return nil, fmt.Errorf("model: input shape must be [C, H, W] with positive sizes, got %v", input)
	}
	if classes < 2 {
		return nil, fmt.Errorf("model: need at least 2 classes, got %d", classes)
	}
	if len(cfg.Input) != 0 && !slices.Equal(cfg.Input, input) {
		return nil, fmt.Errorf("model: model.input %v does not match the data's sample shape %v: fix model.input, or remove it to take the data's", cfg.Input, input)
	}
	if cfg.Classes != 0 && cfg.Classes != classes {
		return nil, fmt.Errorf("model: model.classes %d does not match the data's %d classes: fix model.classes, or remove it to take the data's", cfg.Classes, classes)
	}
	s := &Spec{Input: append([]int(nil), input...), Classes: classes}
	shape := append([]int(nil), input...)
	add := func(l Layer) {
		l.InShape = append([]int(nil), shape...)
		l.Weight, l.Bias = -1, -1
		switch l.Kind {
		case Dense:
			shape = []int{l.Out}
		case Conv2D:
			shape = []int{l.Out, shape[1] + 2*l.Pad - l.Kernel + 1, shape[2] + 2*l.Pad - l.Kernel + 1}
		case MaxPool2:
			shape = []int{shape[0], shape[1] / 2, shape[2] / 2}
		case Flatten:
			shape = []int{prod(shape)}
		}
		l.OutShape = append([]int(nil), shape...)
		s.Layers = append(s.Layers, l)
	}
	if cfg.Type == TypeCNN {
		for i, ch := range cfg.Channels {
			if shape[1] < 2 || shape[2] < 2 {
				return nil, fmt.Errorf("model: channels: %d conv blocks pool a %dx%d input down to nothing; use fewer", len(cfg.Channels), input[1], input[2])
			}
			add(Layer{Kind: Conv2D, Name: fmt.Sprintf("conv%d", i+1), In: shape[0], Out: ch, Kernel: cfg.Kernel, Pad: cfg.Kernel / 2})
			add(Layer{Kind: ReLU})
			add(Layer{Kind: MaxPool2})
		}
	}
	add(Layer{Kind: Flatten})
	for i, h := range cfg.Hidden {
		add(Layer{Kind: Dense, Name: fmt.Sprintf("fc%d", i+1), In: shape[0], Out: h})
		add(Layer{Kind: ReLU})
	}
	add(Layer{Kind: Dense, Name: fmt.Sprintf("fc%d", len(cfg.Hidden)+1), In: shape[0], Out: classes})
	return s, nil
}

// ParamLayers returns the indices of the layers that hold parameters, bottom (input side) first.
func (s *Spec) ParamLayers() []int {
	var idx []int
	for i, l := range s.Layers {
		if l.Kind == Dense || l.Kind == Conv2D {
			idx = append(idx, i)
		}
	}
	return idx
}

// String is a one-line summary such as "784-256-128-10" for an MLP or
// "conv16-pool-conv32-pool-128-10" for a CNN.
func (s *Spec) String() string {
	out := ""
	sep := func() {
		if out != "" {
			out += "-"
		}
	}
	for _, l := range s.Layers {
		switch l.Kind {
		case Conv2D:
			sep()
			out += fmt.Sprintf("conv%d", l.Out)
		case MaxPool2:
			sep()
			out += "pool"
		case Dense:
			if out == "" {
				out = fmt.Sprint(l.In)
			}
			sep()
			out += fmt.Sprint(l.Out)
		}
	}
	return out
}

func prod(s []int) int {
	p := 1
	for _, v := range s {
		p *= v
	}
	return p
}
