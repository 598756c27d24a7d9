package model

import (
	"errors"
	"fmt"
	"slices"
)

// LayerKind is the operation a Layer performs.
type LayerKind uint8

// Layer kinds. Dense, Conv2D, LayerNorm, BatchNorm2d, PatchEmbed and Tokens hold parameters;
// the others do not.
const (
	Dense LayerKind = iota + 1
	Conv2D
	ReLU
	MaxPool2 // 2×2 max-pool, stride 2, no padding
	Flatten
	LayerNorm   // over the last axis (a token's features), as torch.nn.LayerNorm(dim)
	GELU        // the exact (erf) form, torch.nn.GELU()
	Dropout     // P of the elements zeroed in training, the rest scaled by 1/(1−P)
	Residual    // starts a residual branch: its input is kept for the Add that ends it
	Add         // ends a residual branch: adds the input of its Residual to the branch's output
	PatchEmbed  // a Patch×Patch, stride-Patch convolution to Out features, as tokens [T, Out]
	Tokens      // prepends a learned class token and adds learned position embeddings
	Attention   // multi-head self-attention on a fused QKV input [T, 3·D] → [T, D]
	ClassPool   // takes the class token: [T, D] → [D]
	MeanPool    // global average pooling: [C, H, W] → [C], or [T, D] → [D]
	BatchNorm2d // per-channel batch normalisation with running statistics
)

var kindNames = map[LayerKind]string{
	Dense: "dense", Conv2D: "conv2d", ReLU: "relu", MaxPool2: "maxpool2", Flatten: "flatten",
	LayerNorm: "layernorm", GELU: "gelu", Dropout: "dropout", Residual: "residual", Add: "add",
	PatchEmbed: "patch_embed", Tokens: "tokens", Attention: "attention", ClassPool: "cls_pool",
	MeanPool: "mean_pool", BatchNorm2d: "batchnorm2d",
}

func (k LayerKind) String() string {
	if s, ok := kindNames[k]; ok {
		return s
	}
	return fmt.Sprintf("LayerKind(%d)", uint8(k))
}

// HasParams reports whether layers of kind k hold parameter tensors (Weight and Bias).
func (k LayerKind) HasParams() bool {
	switch k {
	case Dense, Conv2D, LayerNorm, BatchNorm2d, PatchEmbed, Tokens:
		return true
	}
	return false
}

// Layer is one step of a network. The layers run in order; a Residual … Add pair brackets a
// branch whose output is added to the branch's input (branches nest). Shapes are per sample
// (no batch dimension): [features] after a Flatten or pooling, [channels, height, width]
// for images, [tokens, features] for a transformer's sequence.
type Layer struct {
	Kind     LayerKind
	Name     string // "fc1", "blocks.0.attn.qkv", ...: the prefix of its tensors' names
	In, Out  int    // Dense: features (of the last axis); Conv2D: channels; PatchEmbed: channels in, features out
	Kernel   int    // Conv2D: square kernel size
	Pad      int    // Conv2D: padding on every side
	Patch    int    // PatchEmbed: patch size (kernel and stride)
	Heads    int    // Attention: heads (Out/Heads features each)
	P        float32
	Eps      float32 // LayerNorm, BatchNorm2d
	Momentum float32 // BatchNorm2d: the running statistics' update weight (PyTorch's 0.1)
	// Block is the index of the residual block the layer belongs to, -1 outside any: a
	// transformer's blocks, which freezing by ratio counts and activation checkpointing
	// cuts between.
	Block    int
	InShape  []int
	OutShape []int
	Weight   int // index of the weight tensor in the Layout, -1 if none
	Bias     int // index of the bias tensor in the Layout, -1 if none
	// Buffers (BatchNorm2d): the layout indices of the running mean and variance, which
	// are saved with the parameters but never trained.
	RunMean, RunVar int
}

// Rows is the number of rows a layer's input has per sample when it works on the last axis
// (Dense, LayerNorm): the tokens of a sequence, 1 for a feature vector.
func (l Layer) Rows() int { return prod(l.InShape[:len(l.InShape)-1]) }

// Spec is a network: an input shape, its layers and the number of classes.
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
	var lcs []LayerConfig
	switch cfg.Type {
	case TypeViT:
		lcs = vitLayers(cfg)
	case TypeLayers:
		lcs = cfg.Layers
	default:
		lcs = sequentialLayers(cfg)
	}
	b := &builder{s: &Spec{Input: append([]int(nil), input...), Classes: classes}, shape: append([]int(nil), input...), block: -1}
	if err := b.addAll(lcs, "layers"); err != nil {
		return nil, fmt.Errorf("model: %w", err)
	}
	s := b.s
	if len(s.Layers) == 0 {
		return nil, errors.New("model: layers: the model has no layers")
	}
	last := s.Layers[len(s.Layers)-1]
	if len(last.OutShape) != 1 || last.OutShape[0] != classes {
		return nil, fmt.Errorf("model: the last layer (%s) outputs %v per sample; the loss needs [%d] (one logit per class): end with a dense layer of %d outputs, or leave its out unset", last.describe(len(s.Layers)-1), last.OutShape, classes, classes)
	}
	if cfg.Type == TypeLayers || cfg.Type == TypeViT {
		if k, n := cfg.Recompute.Segments, len(CutPoints(s)); k > n {
			return nil, fmt.Errorf("model: activation_checkpointing.segments: at most %d for this model (the places it can be cut), got %d", n, k)
		}
	}
	return s, nil
}

// ParamLayers returns the indices of the layers that hold parameters, bottom (input side) first.
func (s *Spec) ParamLayers() []int {
	var idx []int
	for i, l := range s.Layers {
		if l.Kind.HasParams() {
			idx = append(idx, i)
		}
	}
	return idx
}

// String is a one-line summary such as "784-256-128-10" for an MLP or
// "conv16-pool-conv32-pool-128-10" for a CNN.
func (s *Spec) String() string {
	blocks, heads := 0, 0
	for _, l := range s.Layers {
		blocks = max(blocks, l.Block+1)
		if l.Kind == Attention {
			heads = l.Heads
		}
	}
	if s.Layers[0].Kind == PatchEmbed && heads > 0 {
		l := s.Layers[0]
		return fmt.Sprintf("vit-patch%d-dim%d-depth%d-heads%d-%d", l.Patch, l.Out, blocks, heads, s.Classes)
	}
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
