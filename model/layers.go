package model

import (
	"fmt"
	"math"
)

// LayerConfig is one entry of `model.layers` (type layers): a layer, or a group of layers.
type LayerConfig struct {
	// Type is one of dense, conv2d, relu, gelu, maxpool2, flatten, layernorm, dropout,
	// batchnorm2d, patch_embed, tokens, attention, cls_pool, mean_pool (layers), residual
	// (Layers is a branch added to its own input) or block (Layers form one block, the unit
	// freeze.ratio counts and activation checkpointing cuts between).
	Type string `yaml:"type" json:"type"`
	// Name prefixes the layer's tensors ("fc1" → fc1.weight); default: the type and its
	// position ("dense3").
	Name string `yaml:"name" json:"name,omitempty"`
	// Out is the output features (dense, patch_embed) or channels (conv2d). The last layer's
	// dense may leave it out: it is the class count.
	Out    int  `yaml:"out" json:"out,omitempty"`
	Kernel int  `yaml:"kernel" json:"kernel,omitempty"` // conv2d: square kernel (odd)
	Pad    *int `yaml:"pad" json:"pad,omitempty"`       // conv2d: padding; default kernel/2 ("same")
	Patch  int  `yaml:"patch" json:"patch,omitempty"`   // patch_embed: patch size and stride
	Heads  int  `yaml:"heads" json:"heads,omitempty"`   // attention: heads
	// P is dropout's probability of zeroing an element.
	P float64 `yaml:"p" json:"p,omitempty"`
	// Eps is layernorm's and batchnorm2d's epsilon (default 1e-6 and 1e-5, as timm's ViT
	// and torch.nn.BatchNorm2d).
	Eps float64 `yaml:"eps" json:"eps,omitempty"`
	// Layers is a residual's branch or a block's layers.
	Layers []LayerConfig `yaml:"layers" json:"layers,omitempty"`
}

var layerTypes = map[string]bool{
	"dense": true, "conv2d": true, "relu": true, "gelu": true, "maxpool2": true, "flatten": true,
	"layernorm": true, "dropout": true, "batchnorm2d": true, "patch_embed": true, "tokens": true,
	"attention": true, "cls_pool": true, "mean_pool": true, "residual": true, "block": true,
}

// validateLayers checks what can be checked without shapes; errors name the entry by path
// ("layers[2].layers[0]").
func validateLayers(lcs []LayerConfig, path string) error {
	for i, lc := range lcs {
		at := fmt.Sprintf("%s[%d]", path, i)
		if !layerTypes[lc.Type] {
			return fmt.Errorf("%s.type: unknown layer type %q (want one of dense, conv2d, relu, gelu, maxpool2, flatten, layernorm, dropout, batchnorm2d, patch_embed, tokens, attention, cls_pool, mean_pool, residual, block)", at, lc.Type)
		}
		group := lc.Type == "residual" || lc.Type == "block"
		if group != (len(lc.Layers) > 0) {
			if group {
				return fmt.Errorf("%s.layers: a %s needs a list of layers", at, lc.Type)
			}
			return fmt.Errorf("%s.layers: only a residual or a block holds layers, not a %s", at, lc.Type)
		}
		switch lc.Type {
		case "conv2d":
			if lc.Out < 1 || lc.Out > 1<<16 {
				return fmt.Errorf("%s.out: conv2d needs out channels in [1, 65536], got %d", at, lc.Out)
			}
			if lc.Kernel < 1 || lc.Kernel > 15 {
				return fmt.Errorf("%s.kernel: must be in [1, 15], got %d", at, lc.Kernel)
			}
			if lc.Pad != nil && (*lc.Pad < 0 || *lc.Pad >= lc.Kernel) {
				return fmt.Errorf("%s.pad: must be in [0, kernel), got %d", at, *lc.Pad)
			}
		case "dense", "patch_embed":
			if lc.Out < 0 || lc.Out > 1<<20 {
				return fmt.Errorf("%s.out: must be in [1, 1048576], got %d", at, lc.Out)
			}
			if lc.Type == "patch_embed" && (lc.Out < 1 || lc.Patch < 1) {
				return fmt.Errorf("%s: patch_embed needs out (features) and patch (size) >= 1, got out %d, patch %d", at, lc.Out, lc.Patch)
			}
		case "attention":
			if lc.Heads < 1 {
				return fmt.Errorf("%s.heads: attention needs heads >= 1, got %d", at, lc.Heads)
			}
		case "dropout":
			if !(lc.P >= 0 && lc.P < 1) {
				return fmt.Errorf("%s.p: must be in [0, 1), got %v", at, lc.P)
			}
		case "layernorm", "batchnorm2d":
			if lc.Eps < 0 || math.IsNaN(lc.Eps) {
				return fmt.Errorf("%s.eps: must be >= 0, got %v", at, lc.Eps)
			}
		}
		if group {
			if err := validateLayers(lc.Layers, at+".layers"); err != nil {
				return err
			}
		}
	}
	return nil
}

// ViT defaults: ViT-Tiny/16 (Touvron et al. 2021's DeiT-Ti), the smallest published ViT.
const (
	vitPatch    = 16
	vitDim      = 192
	vitDepth    = 12
	vitHeads    = 3
	vitMLPRatio = 4.0
)

// ViTConfig returns c's ViT fields with the defaults filled in.
func (c Config) ViTConfig() (patch, dim, depth, heads int, mlpRatio, dropout float64) {
	patch, dim, depth, heads, mlpRatio = c.Patch, c.Dim, c.Depth, c.Heads, c.MLPRatio
	if patch == 0 {
		patch = vitPatch
	}
	if dim == 0 {
		dim = vitDim
	}
	if depth == 0 {
		depth = vitDepth
	}
	if heads == 0 {
		heads = vitHeads
	}
	if mlpRatio == 0 {
		mlpRatio = vitMLPRatio
	}
	return patch, dim, depth, heads, mlpRatio, c.Dropout
}

func (c Config) validateViT() error {
	patch, dim, depth, heads, ratio, drop := c.ViTConfig()
	switch {
	case patch < 1 || patch > 64:
		return fmt.Errorf("patch: must be in [1, 64], got %d", patch)
	case dim < 1 || dim > 8192:
		return fmt.Errorf("dim: must be in [1, 8192], got %d", dim)
	case depth < 1 || depth > 128:
		return fmt.Errorf("depth: must be in [1, 128], got %d", depth)
	case heads < 1 || dim%heads != 0:
		return fmt.Errorf("heads: must divide dim %d, got %d", dim, heads)
	case !(ratio > 0 && ratio <= 16) || int(math.Round(ratio*float64(dim))) < 1:
		return fmt.Errorf("mlp_ratio: must be in (0, 16], got %v", ratio)
	case !(drop >= 0 && drop < 1):
		return fmt.Errorf("dropout: must be in [0, 1), got %v", drop)
	}
	return nil
}

// vitLayers is a pre-norm ViT with a class token, named as timm's VisionTransformer names
// its tensors (patch_embed.proj, cls_token, pos_embed, blocks.N.norm1, blocks.N.attn.qkv,
// blocks.N.attn.proj, blocks.N.norm2, blocks.N.mlp.fc1, blocks.N.mlp.fc2, norm, head), so a
// timm checkpoint maps with few or no init_map rules.
func vitLayers(c Config) []LayerConfig {
	patch, dim, depth, heads, ratio, drop := c.ViTConfig()
	dropout := func() []LayerConfig {
		if drop == 0 {
			return nil
		}
		return []LayerConfig{{Type: "dropout", P: drop}}
	}
	var out []LayerConfig
	out = append(out, LayerConfig{Type: "patch_embed", Name: "patch_embed.proj", Out: dim, Patch: patch})
	out = append(out, LayerConfig{Type: "tokens"})
	out = append(out, dropout()...)
	for i := 0; i < depth; i++ {
		p := fmt.Sprintf("blocks.%d.", i)
		attn := append([]LayerConfig{{Type: "layernorm", Name: p + "norm1"}, {Type: "attention", Name: p + "attn", Heads: heads}}, dropout()...)
		mlp := []LayerConfig{{Type: "layernorm", Name: p + "norm2"}, {Type: "dense", Name: p + "mlp.fc1", Out: int(math.Round(ratio * float64(dim)))}, {Type: "gelu"}}
		mlp = append(mlp, dropout()...)
		mlp = append(mlp, LayerConfig{Type: "dense", Name: p + "mlp.fc2", Out: dim})
		mlp = append(mlp, dropout()...)
		out = append(out, LayerConfig{Type: "block", Layers: []LayerConfig{{Type: "residual", Layers: attn}, {Type: "residual", Layers: mlp}}})
	}
	out = append(out, LayerConfig{Type: "layernorm", Name: "norm"}, LayerConfig{Type: "cls_pool"}, LayerConfig{Type: "dense", Name: "head"})
	return out
}

// sequentialLayers is the MLP or CNN of Type mlp/cnn, with their historical names (conv1,
// fc1, ...).
func sequentialLayers(c Config) []LayerConfig {
	var out []LayerConfig
	if c.Type == TypeCNN {
		for i, ch := range c.Channels {
			pad := c.Kernel / 2
			out = append(out, LayerConfig{Type: "conv2d", Name: fmt.Sprintf("conv%d", i+1), Out: ch, Kernel: c.Kernel, Pad: &pad},
				LayerConfig{Type: "relu"}, LayerConfig{Type: "maxpool2"})
		}
	}
	out = append(out, LayerConfig{Type: "flatten"})
	for i, h := range c.Hidden {
		out = append(out, LayerConfig{Type: "dense", Name: fmt.Sprintf("fc%d", i+1), Out: h}, LayerConfig{Type: "relu"})
	}
	return append(out, LayerConfig{Type: "dense", Name: fmt.Sprintf("fc%d", len(c.Hidden)+1)})
}

// builder expands LayerConfigs into a Spec's layers, inferring shapes.
type builder struct {
	s       *Spec
	shape   []int
	block   int // the current block, -1 outside
	nblocks int
	seen    map[string]bool
}

func (b *builder) addAll(lcs []LayerConfig, path string) error {
	for i, lc := range lcs {
		last := path == "layers" && i == len(lcs)-1
		if err := b.add(lc, fmt.Sprintf("%s[%d]", path, i), last); err != nil {
			return err
		}
	}
	return nil
}

// push appends a layer of the current shape, which then becomes out.
func (b *builder) push(l Layer, out []int) error {
	l.InShape = append([]int(nil), b.shape...)
	l.OutShape = append([]int(nil), out...)
	l.Weight, l.Bias, l.RunMean, l.RunVar = -1, -1, -1, -1
	l.Block = b.block
	if l.Kind.HasParams() {
		if l.Name == "" && l.Kind != Tokens {
			l.Name = fmt.Sprintf("%s%d", l.Kind, len(b.s.Layers))
		}
		if b.seen == nil {
			b.seen = map[string]bool{}
		}
		if b.seen[l.Name] {
			return fmt.Errorf("two layers are named %q: names must be unique (they name the tensors)", l.Name)
		}
		b.seen[l.Name] = true
	}
	for _, v := range out {
		if v < 1 {
			return fmt.Errorf("%s: output shape %v has an empty axis", l.Kind, out)
		}
	}
	b.s.Layers = append(b.s.Layers, l)
	b.shape = append([]int(nil), out...)
	return nil
}

func (b *builder) add(lc LayerConfig, at string, last bool) error {
	sh := b.shape
	fail := func(format string, args ...any) error {
		name := lc.Type
		if lc.Name != "" {
			name += " " + lc.Name
		}
		return fmt.Errorf("%s (%s, input %v per sample): %s", at, name, sh, fmt.Sprintf(format, args...))
	}
	wrap := func(err error) error {
		if err != nil {
			return fail("%v", err)
		}
		return nil
	}
	eps := func(def float64) float32 {
		if lc.Eps == 0 {
			return float32(def)
		}
		return float32(lc.Eps)
	}
	switch lc.Type {
	case "dense":
		if len(sh) > 2 {
			return fail("dense works on features or tokens; put a flatten (or a pooling) before it")
		}
		out := lc.Out
		if out == 0 {
			if !last {
				return fail("out: only the last layer may leave out unset (it is then the class count)")
			}
			out = b.s.Classes
		}
		o := append(append([]int(nil), sh[:len(sh)-1]...), out)
		return wrap(b.push(Layer{Kind: Dense, Name: lc.Name, In: sh[len(sh)-1], Out: out}, o))
	case "conv2d":
		if len(sh) != 3 {
			return fail("conv2d needs an image [C, H, W]")
		}
		pad := lc.Kernel / 2
		if lc.Pad != nil {
			pad = *lc.Pad
		}
		oh, ow := sh[1]+2*pad-lc.Kernel+1, sh[2]+2*pad-lc.Kernel+1
		if oh < 1 || ow < 1 {
			return fail("kernel %d with padding %d is larger than the %dx%d input", lc.Kernel, pad, sh[1], sh[2])
		}
		return wrap(b.push(Layer{Kind: Conv2D, Name: lc.Name, In: sh[0], Out: lc.Out, Kernel: lc.Kernel, Pad: pad}, []int{lc.Out, oh, ow}))
	case "relu":
		return wrap(b.push(Layer{Kind: ReLU}, sh))
	case "gelu":
		return wrap(b.push(Layer{Kind: GELU}, sh))
	case "dropout":
		if lc.P == 0 {
			return nil // a no-op in training and evaluation alike
		}
		return wrap(b.push(Layer{Kind: Dropout, P: float32(lc.P)}, sh))
	case "maxpool2":
		if len(sh) != 3 || sh[1] < 2 || sh[2] < 2 {
			return fail("maxpool2 needs an image [C, H, W] of at least 2x2")
		}
		return wrap(b.push(Layer{Kind: MaxPool2}, []int{sh[0], sh[1] / 2, sh[2] / 2}))
	case "flatten":
		return wrap(b.push(Layer{Kind: Flatten}, []int{prod(sh)}))
	case "layernorm":
		if len(sh) > 2 {
			return fail("layernorm normalises features or tokens; for images use batchnorm2d")
		}
		return wrap(b.push(Layer{Kind: LayerNorm, Name: lc.Name, In: sh[len(sh)-1], Out: sh[len(sh)-1], Eps: eps(1e-6)}, sh))
	case "batchnorm2d":
		if len(sh) != 3 {
			return fail("batchnorm2d needs an image [C, H, W]")
		}
		return wrap(b.push(Layer{Kind: BatchNorm2d, Name: lc.Name, In: sh[0], Out: sh[0], Eps: eps(1e-5), Momentum: 0.1}, sh))
	case "patch_embed":
		if len(sh) != 3 {
			return fail("patch_embed needs an image [C, H, W]")
		}
		if sh[1]%lc.Patch != 0 || sh[2]%lc.Patch != 0 {
			return fail("patch %d does not divide the %dx%d input (set data.image_size to a multiple)", lc.Patch, sh[1], sh[2])
		}
		t := (sh[1] / lc.Patch) * (sh[2] / lc.Patch)
		return wrap(b.push(Layer{Kind: PatchEmbed, Name: lc.Name, In: sh[0], Out: lc.Out, Patch: lc.Patch, Kernel: lc.Patch}, []int{t, lc.Out}))
	case "tokens":
		if len(sh) != 2 {
			return fail("tokens needs a sequence [T, D] (after a patch_embed)")
		}
		return wrap(b.push(Layer{Kind: Tokens, Name: lc.Name, In: sh[1], Out: sh[1]}, []int{sh[0] + 1, sh[1]}))
	case "attention":
		if len(sh) != 2 {
			return fail("attention needs a sequence [T, D]")
		}
		d := sh[1]
		if d%lc.Heads != 0 {
			return fail("heads %d does not divide the %d features", lc.Heads, d)
		}
		name := lc.Name
		if name == "" {
			name = fmt.Sprintf("attn%d", len(b.s.Layers))
		}
		if err := b.push(Layer{Kind: Dense, Name: name + ".qkv", In: d, Out: 3 * d}, []int{sh[0], 3 * d}); err != nil {
			return wrap(err)
		}
		if err := b.push(Layer{Kind: Attention, Heads: lc.Heads, In: 3 * d, Out: d}, []int{sh[0], d}); err != nil {
			return wrap(err)
		}
		return wrap(b.push(Layer{Kind: Dense, Name: name + ".proj", In: d, Out: d}, []int{sh[0], d}))
	case "cls_pool":
		if len(sh) != 2 {
			return fail("cls_pool needs a sequence [T, D] whose first token is the class token")
		}
		return wrap(b.push(Layer{Kind: ClassPool}, []int{sh[1]}))
	case "mean_pool":
		switch len(sh) {
		case 3:
			return wrap(b.push(Layer{Kind: MeanPool}, []int{sh[0]}))
		case 2:
			return wrap(b.push(Layer{Kind: MeanPool}, []int{sh[1]}))
		}
		return fail("mean_pool needs an image [C, H, W] or a sequence [T, D]")
	case "residual":
		in := append([]int(nil), sh...)
		if err := b.push(Layer{Kind: Residual}, sh); err != nil {
			return wrap(err)
		}
		if err := b.addAll(lc.Layers, at+".layers"); err != nil {
			return err
		}
		if !equalInts(b.shape, in) {
			return fmt.Errorf("%s (residual): its branch turns %v into %v; a residual branch must keep its input's shape", at, in, b.shape)
		}
		return wrap(b.push(Layer{Kind: Add}, in))
	case "block":
		if b.block >= 0 {
			return fail("blocks cannot nest")
		}
		b.block = b.nblocks
		b.nblocks++
		err := b.addAll(lc.Layers, at+".layers")
		b.block = -1
		return err
	}
	return fail("unknown layer type %q", lc.Type)
}

func equalInts(a, b []int) bool {
	if len(a) != len(b) {
		return false
	}
	for i := range a {
		if a[i] != b[i] {
			return false
		}
	}
	return true
}

// describe names layer i for messages: "layer 4 (dense blocks.0.attn.qkv)".
func (l Layer) describe(i int) string {
	if l.Name != "" {
		return fmt.Sprintf("layer %d (%s %s)", i, l.Kind, l.Name)
	}
	return fmt.Sprintf("layer %d (%s)", i, l.Kind)
}

// CutPoints are the layers activation checkpointing may start a segment at: outside every
// residual branch (a branch's input must stay until its Add), just before a layer with
// parameters or a residual branch; the first is always layer 0. For an MLP or a CNN they are
// its weight layers (the first moved to 0).
func CutPoints(s *Spec) []int {
	var cuts []int
	depth := 0
	for i, l := range s.Layers {
		if depth == 0 && (l.Kind.HasParams() || l.Kind == Residual) {
			cuts = append(cuts, i)
		}
		switch l.Kind {
		case Residual:
			depth++
		case Add:
			depth--
		}
	}
	if len(cuts) == 0 {
		return []int{0}
	}
	cuts[0] = 0
	return cuts
}

// Blocks is the number of blocks (type block entries; a ViT's transformer blocks).
func (s *Spec) Blocks() int {
	n := 0
	for _, l := range s.Layers {
		n = max(n, l.Block+1)
	}
	return n
}

// DropoutKeep reports whether element i survives a dropout of probability p drawn with seed:
// a SplitMix64 hash of (seed, i) compared, as a 24-bit fraction, with p. Every engine and
// backend computes this same function, so a mask is identical on every device.
func DropoutKeep(seed, i uint64, p float32) bool {
	z := seed + (i+1)*0x9E3779B97F4A7C15
	z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9
	z = (z ^ (z >> 27)) * 0x94D049BB133111EB
	z ^= z >> 31
	return float32(z>>40)*(1.0/(1<<24)) >= p
}

// LayerSeed is the dropout seed of layer i in a pass seeded with seed (the trainer's
// per-micro-batch seed): each dropout layer draws its own mask.
func LayerSeed(seed uint64, i int) uint64 {
	z := seed ^ (uint64(i+1) * 0xD1B54A32D192ED03)
	z = (z ^ (z >> 33)) * 0xFF51AFD7ED558CCD
	return z ^ (z >> 33)
}
