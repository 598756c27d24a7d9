package model

import (
	"fmt"
)

// Model types.
const (
	TypeMLP    = "mlp"
	TypeCNN    = "cnn"
	TypeViT    = "vit"    // a Vision Transformer (Dosovitskiy et al. 2021), pre-norm, class token
	TypeLayers = "layers" // the layers list, for models that are none of the named types
)

// Config describes the network. YAML under `model:`.
type Config struct {
	// Type is "mlp" (flatten, then Hidden dense+ReLU layers, then the classifier) or "cnn"
	// (for each of Channels: conv Kernel×Kernel with same padding + ReLU + 2×2 max-pool; then
	// flatten, the Hidden dense+ReLU layers and the classifier).
	Type     string `yaml:"type" json:"type"`
	Hidden   []int  `yaml:"hidden" json:"hidden"`
	Channels []int  `yaml:"channels" json:"channels"`
	Kernel   int    `yaml:"kernel" json:"kernel"`
	// ViT: Patch×Patch patches embedded to Dim features, Depth pre-norm transformer blocks of
	// Heads attention heads and an MLP of MLPRatio×Dim hidden features, Dropout after the
	// embeddings, the attention projection and each MLP layer; the class token's final
	// features feed the classifier. (ViT-Tiny/16 is patch 16, dim 192, depth 12, heads 3.)
	Patch    int     `yaml:"patch" json:"patch,omitempty"`
	Dim      int     `yaml:"dim" json:"dim,omitempty"`
	Depth    int     `yaml:"depth" json:"depth,omitempty"`
	Heads    int     `yaml:"heads" json:"heads,omitempty"`
	MLPRatio float64 `yaml:"mlp_ratio" json:"mlp_ratio,omitempty"`
	Dropout  float64 `yaml:"dropout" json:"dropout,omitempty"`
	// Layers is the general form (type layers, implied when layers is given without a
	// type): the network as a list, residual branches nested in it.
	Layers []LayerConfig `yaml:"layers" json:"layers,omitempty"`
	// Input and Classes, where set, declare the sample shape [C, H, W] and the class count
	// the model is meant for; they come from the data, and a dataset that disagrees is an
	// error naming both. Unset (the default), the model takes whatever the data has.
	Input   []int `yaml:"input" json:"input,omitempty"`
	Classes int   `yaml:"classes" json:"classes,omitempty"`
	// Recompute trades compute for activation memory (Chen et al. 2016, "Training Deep Nets
	// with Sublinear Memory Cost"). The YAML key keeps the ecosystem's name for it,
	// `activation_checkpointing:` (PyTorch, DeepSpeed); the code says recompute so that
	// "checkpoint" always means a saved training state.
	Recompute RecomputeConfig `yaml:"activation_checkpointing" json:"activation_checkpointing"`
}

// RecomputeConfig configures activation recomputation.
type RecomputeConfig struct {
	// Segments splits the layers into this many contiguous segments, each starting at a
	// weight layer: the forward pass keeps only each segment's input and the backward pass
	// recomputes the segment from it. 0 or 1 is off; at most the number of weight layers.
	Segments int `yaml:"segments" json:"segments"`
}

// DefaultConfig is the MLP 784-256-128-10 of the Fashion-MNIST baselines.
func DefaultConfig() Config {
	return Config{Type: TypeMLP, Hidden: []int{256, 128}, Kernel: 3}
}

// Validate checks the fields; errors name the field by its YAML name.
func (c Config) Validate() error {
	switch c.Type {
	case TypeMLP:
		if len(c.Channels) > 0 {
			return fmt.Errorf("channels: only used by type cnn, got %v for type mlp", c.Channels)
		}
	case TypeCNN:
		if len(c.Channels) == 0 {
			return fmt.Errorf("channels: type cnn needs at least one conv block, e.g. [16, 32]")
		}
		for i, ch := range c.Channels {
			if ch < 1 || ch > 4096 {
				return fmt.Errorf("channels[%d]: must be in [1, 4096], got %d", i, ch)
			}
		}
		if c.Kernel < 1 || c.Kernel%2 == 0 || c.Kernel > 11 {
			return fmt.Errorf("kernel: must be odd and in [1, 11] (same padding), got %d", c.Kernel)
		}
	case TypeViT:
		if err := c.validateViT(); err != nil {
			return err
		}
	case TypeLayers:
		if len(c.Layers) == 0 {
			return fmt.Errorf("layers: type layers needs a list of layers")
		}
		if err := validateLayers(c.Layers, "layers"); err != nil {
			return err
		}
	default:
		return fmt.Errorf("type: unknown model type %q (want %s, %s, %s or %s)", c.Type, TypeMLP, TypeCNN, TypeViT, TypeLayers)
	}
	if c.Type != TypeLayers && len(c.Layers) > 0 {
		return fmt.Errorf("layers: only used by type layers (leave type out, or set it to layers), got type %s", c.Type)
	}
	if c.Type == TypeViT || c.Type == TypeLayers {
		if len(c.Hidden) > 0 || len(c.Channels) > 0 {
			return fmt.Errorf("hidden/channels: only used by types mlp and cnn, got type %s", c.Type)
		}
	} else if c.Patch != 0 || c.Dim != 0 || c.Depth != 0 || c.Heads != 0 || c.MLPRatio != 0 || c.Dropout != 0 {
		return fmt.Errorf("patch/dim/depth/heads/mlp_ratio/dropout: only used by type vit, got type %s", c.Type)
	}
	if len(c.Input) != 0 && (len(c.Input) != 3 || c.Input[0] < 1 || c.Input[1] < 1 || c.Input[2] < 1) {
		return fmt.Errorf("input: must be [C, H, W] with positive sizes, or empty to take it from the data, got %v", c.Input)
	}
	if c.Classes != 0 && c.Classes < 2 {
		return fmt.Errorf("classes: must be >= 2, or 0 to take it from the data, got %d", c.Classes)
	}
	for i, h := range c.Hidden {
		if h < 1 || h > 1<<16 {
			return fmt.Errorf("hidden[%d]: must be in [1, 65536], got %d", i, h)
		}
	}
	if k := c.Recompute.Segments; k < 0 {
		return fmt.Errorf("activation_checkpointing.segments: must be >= 0 (0 or 1 is off), got %d", k)
	}
	if c.Type == TypeViT || c.Type == TypeLayers {
		return nil // the upper bound depends on the expanded model: NewSpec checks it
	}
	if k, n := c.Recompute.Segments, c.WeightLayers(); k < 0 || k > n {
		return fmt.Errorf("activation_checkpointing.segments: must be in [0, %d] (0 or 1 is off; at most the %d weight layers of this model), got %d", n, n, k)
	}
	return nil
}

// WeightLayers is the number of layers with weights (conv and dense, the classifier included):
// the most segments activation checkpointing can split the model into.
func (c Config) WeightLayers() int {
	n := len(c.Hidden) + 1
	if c.Type == TypeCNN {
		n += len(c.Channels)
	}
	return n
}
