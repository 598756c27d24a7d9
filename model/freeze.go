package model

import (
	"fmt"
	"math"
	"path"
)

// FreezeConfig says which parameters are not trained (YAML `freeze:`), as the memory guides'
// fine-tuning recipes freeze the bottom of a pretrained network: frozen tensors get no
// gradient, no optimizer state and no communication, and are left out of ZeRO's partition.
type FreezeConfig struct {
	// Ratio freezes the bottom fraction of the model (0.85 of 3 layers freezes 2). In a model
	// with blocks (a ViT's transformer blocks) it counts blocks: the first floor(ratio ×
	// blocks) blocks are frozen, with every layer before the first block (the embeddings), as
	// the DINOv3 fine-tuning recipes freeze a backbone's bottom. Otherwise it counts layers
	// with parameters: the first floor(ratio × layers), weights and biases.
	Ratio float64 `yaml:"ratio" json:"ratio"`
	// Names freezes the tensors whose names match any of these patterns (path.Match syntax:
	// "fc1.*", "conv?.weight").
	Names []string `yaml:"names" json:"names"`
}

// Validate checks the fields; errors name the field.
func (c FreezeConfig) Validate() error {
	if c.Ratio < 0 || c.Ratio >= 1 || math.IsNaN(c.Ratio) {
		return fmt.Errorf("ratio: must be in [0, 1) (the share of layers frozen; 1 would leave nothing to train), got %v", c.Ratio)
	}
	for i, p := range c.Names {
		if _, err := path.Match(p, ""); err != nil {
			return fmt.Errorf("names[%d]: %q is not a valid pattern: %w", i, p, err)
		}
	}
	return nil
}

// Enabled says whether anything is to be frozen.
func (c FreezeConfig) Enabled() bool { return c.Ratio > 0 || len(c.Names) > 0 }

// Frozen returns the predicate on tensor names that NewLayoutFrozen takes, for spec. A
// pattern that matches no tensor of the model is an error (a typo would otherwise silently
// train what was meant to be frozen), as is freezing every layer.
func (c FreezeConfig) Frozen(spec *Spec) (func(name string) bool, error) {
	if !c.Enabled() {
		return nil, nil
	}
	var names []string
	set := map[string]bool{}
	blocks := spec.Blocks()
	var k int
	if blocks > 0 {
		k = int(math.Floor(c.Ratio * float64(blocks)))
	} else {
		k = int(math.Floor(c.Ratio * float64(len(spec.ParamLayers()))))
	}
	seenBlock, nth := false, 0
	for _, l := range spec.Layers {
		seenBlock = seenBlock || l.Block >= 0
		if !l.Kind.HasParams() {
			continue
		}
		ts := layerTensors(l)
		var freeze bool
		if blocks > 0 {
			freeze = k > 0 && ((!seenBlock && l.Block < 0) || (l.Block >= 0 && l.Block < k))
		} else {
			freeze = nth < k
		}
		nth++
		for _, t := range ts {
			if t.buffer {
				continue
			}
			names = append(names, t.name)
			if freeze {
				set[t.name] = true
			}
		}
	}
	for i, p := range c.Names {
		hit := false
		for _, n := range names {
			if ok, _ := path.Match(p, n); ok {
				set[n], hit = true, true
			}
		}
		if !hit {
			return nil, fmt.Errorf("freeze.names[%d]: %q matches no parameter of the model (they are %v)", i, p, names)
		}
	}
	if len(set) == len(names) {
		return nil, fmt.Errorf("freeze: every parameter of the model would be frozen (ratio %v, names %v): nothing left to train", c.Ratio, c.Names)
	}
	return func(name string) bool { return set[name] }, nil
}
