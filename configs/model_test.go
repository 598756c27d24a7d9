package configs

import (
	"strings"
	"testing"

	"github.com/qvd/qvd/model"
)

// `layers` without a type means type layers, the MLP's default hidden sizes do not leak into
// a vit or layers model, and a layer entry's unknown key is an error naming its path.
func TestModelTypeDefaults(t *testing.T) {
	c, err := Parse([]byte("model:\n  layers:\n    - {type: flatten}\n    - {type: dense}\n"), "t")
	if err != nil {
		t.Fatal(err)
	}
	if c.Model.Type != model.TypeLayers || c.Model.Hidden != nil || len(c.Model.Layers) != 2 || c.Model.Layers[1].Type != "dense" {
		t.Errorf("got %+v", c.Model)
	}
	if err := c.Model.Validate(); err != nil {
		t.Error(err)
	}
	c, err = Parse([]byte("model: {type: vit, patch: 7, dim: 32, depth: 2, heads: 2}\n"), "t")
	if err != nil {
		t.Fatal(err)
	}
	if c.Model.Hidden != nil {
		t.Errorf("vit keeps hidden %v", c.Model.Hidden)
	}
	if err := c.Model.Validate(); err != nil {
		t.Error(err)
	}
	c, err = Parse([]byte("model: {type: mlp}\n"), "t")
	if err != nil || len(c.Model.Hidden) != 2 {
		t.Errorf("mlp lost its default hidden sizes: %v %v", c.Model.Hidden, err)
	}
	_, err = Parse([]byte("model:\n  layers:\n    - {type: flatten}\n    - {type: dense, outs: 3}\n"), "t")
	if err == nil || !strings.Contains(err.Error(), "model.layers[1].outs (line 4): unknown key") {
		t.Errorf("error %v, want one naming model.layers[1].outs", err)
	}
	_, err = Parse([]byte("model:\n  type: vit\n  hidden: [3]\n"), "t")
	if err != nil {
		t.Fatal(err)
	}
}

// Every embedded config builds its model for Fashion-MNIST's shape.
func TestEmbeddedModelsBuild(t *testing.T) {
	for _, name := range Embedded() {
		c, err := Load(name)
		if err != nil {
			t.Fatalf("%s: %v", name, err)
		}
		if _, err := model.NewSpec(c.Model, []int{1, 28, 28}, 10); err != nil {
			t.Errorf("%s: %v", name, err)
		}
	}
}
