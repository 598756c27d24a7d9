package model

import (
	"fmt"
)

// Model types.
const (
	TypeMLP = "mlp"
	TypeCNN = "cnn"
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
	// Input and Classes, where set, declare the sample shape [C, H, W] and the class count
	// the model is meant for; they come from the data, and a dataset that disagrees is an
	// error naming both. Unset (the default), the model takes whatever the data has.
	Input   []int `yaml:"input" json:"input,omitempty"`
	Classes int   `yaml:"classes" json:"classes,omitempty"`
	// ActivationCheckpointing trades compute for activation memory (Chen et al. 2016,
	// "Training Deep Nets with Sublinear Memory Cost"). YAML `activation_checkpointing:`.
	ActivationCheckpointing CheckpointingConfig `yaml:"activation_checkpointing" json:"activation_checkpointing"`
}

// CheckpointingConfig configures activation checkpointing.
type CheckpointingConfig struct {
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
	default:
		return fmt.Errorf("type: unknown model type %q (want %s or %s)", c.Type, TypeMLP, TypeCNN)
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
	if k, n := c.ActivationCheckpointing.Segments, c.WeightLayers(); k < 0 || k > n {
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
