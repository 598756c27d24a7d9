package model

import (
	"strings"
	"testing"
)

func intp(v int) *int { return &v }

// The layers list and the ViT expand into layers with inferred shapes; what cannot be built
// is an error naming the entry.
func TestLayersSpec(t *testing.T) {
	resnet := []LayerConfig{
		{Type: "conv2d", Out: 8, Kernel: 3},
		{Type: "batchnorm2d"},
		{Type: "relu"},
		{Type: "residual", Layers: []LayerConfig{{Type: "conv2d", Out: 8, Kernel: 3}, {Type: "batchnorm2d"}, {Type: "relu"}}},
		{Type: "mean_pool"},
		{Type: "dense"},
	}
	for _, tc := range []struct {
		name   string
		cfg    Config
		input  []int
		kinds  string // the layer kinds, space separated
		params int
		err    string
	}{
		{name: "resnet", cfg: Config{Type: TypeLayers, Layers: resnet}, input: []int{1, 6, 6},
			kinds:  "conv2d batchnorm2d relu residual conv2d batchnorm2d relu add mean_pool dense",
			params: (8*9 + 8) + 8*2 + (8*8*9 + 8) + 8*2 + (8*3 + 3)},
		{name: "vit", cfg: Config{Type: TypeViT, Patch: 2, Dim: 8, Depth: 1, Heads: 2, MLPRatio: 2, Dropout: 0.1}, input: []int{1, 4, 4},
			kinds:  "patch_embed tokens dropout residual layernorm dense attention dense dropout add residual layernorm dense gelu dropout dense dropout add layernorm cls_pool dense",
			params: (8*4 + 8) + 8 + 5*8 + 16 + (8*24 + 24) + (8*8 + 8) + 16 + (8*16 + 16) + (16*8 + 8) + 16 + (8*3 + 3)},
		{name: "dense on an image", cfg: Config{Type: TypeLayers, Layers: []LayerConfig{{Type: "dense", Name: "fc"}}}, input: []int{1, 4, 4},
			err: "layers[0] (dense fc, input [1 4 4] per sample): dense works on features or tokens"},
		{name: "patch does not divide", cfg: Config{Type: TypeViT, Patch: 3, Dim: 8, Depth: 1, Heads: 2}, input: []int{1, 4, 4},
			err: "patch 3 does not divide the 4x4 input"},
		{name: "residual changes shape", cfg: Config{Type: TypeLayers, Layers: []LayerConfig{{Type: "flatten"}, {Type: "residual", Layers: []LayerConfig{{Type: "dense", Out: 3}}}, {Type: "dense"}}}, input: []int{1, 2, 2},
			err: "layers[1] (residual): its branch turns [4] into [3]"},
		{name: "middle dense without out", cfg: Config{Type: TypeLayers, Layers: []LayerConfig{{Type: "flatten"}, {Type: "dense"}, {Type: "relu"}, {Type: "dense"}}}, input: []int{1, 2, 2},
			err: "only the last layer may leave out unset"},
		{name: "not ending in logits", cfg: Config{Type: TypeLayers, Layers: []LayerConfig{{Type: "flatten"}, {Type: "dense", Out: 7}}}, input: []int{1, 2, 2},
			err: "outputs [7] per sample; the loss needs [3]"},
		{name: "duplicate names", cfg: Config{Type: TypeLayers, Layers: []LayerConfig{{Type: "flatten"}, {Type: "dense", Name: "a", Out: 4}, {Type: "dense", Name: "a"}}}, input: []int{1, 2, 2},
			err: `two layers are named "a"`},
		{name: "heads do not divide", cfg: Config{Type: TypeViT, Patch: 2, Dim: 6, Depth: 1, Heads: 4}, input: []int{1, 4, 4},
			err: "heads: must divide dim 6, got 4"},
		{name: "unknown type", cfg: Config{Type: TypeLayers, Layers: []LayerConfig{{Type: "conv3d"}}}, input: []int{1, 2, 2},
			err: `layers[0].type: unknown layer type "conv3d"`},
		{name: "conv pad", cfg: Config{Type: TypeLayers, Layers: []LayerConfig{{Type: "conv2d", Out: 2, Kernel: 3, Pad: intp(0)}, {Type: "flatten"}, {Type: "dense"}}}, input: []int{1, 4, 4},
			kinds: "conv2d flatten dense", params: (2*9 + 2) + (8*3 + 3)},
		{name: "segments over the cut points", cfg: Config{Type: TypeViT, Patch: 2, Dim: 8, Depth: 1, Heads: 2, Recompute: RecomputeConfig{Segments: 7}}, input: []int{1, 4, 4},
			err: "activation_checkpointing.segments: at most 6"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			s, err := NewSpec(tc.cfg, tc.input, 3)
			if tc.err != "" {
				if err == nil || !strings.Contains(err.Error(), tc.err) {
					t.Fatalf("error %v, want one containing %q", err, tc.err)
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			var kinds []string
			for _, l := range s.Layers {
				kinds = append(kinds, l.Kind.String())
			}
			if got := strings.Join(kinds, " "); got != tc.kinds {
				t.Errorf("layers %q, want %q", got, tc.kinds)
			}
			lay := NewLayout(s)
			n := 0
			for _, tt := range lay.Tensors {
				if !tt.Buffer {
					n += tt.Size
				}
			}
			if n != tc.params {
				t.Errorf("%d parameters, want %d", n, tc.params)
			}
		})
	}
}

// Freezing by ratio counts blocks in a model that has them, embeddings included, and cut
// points never fall inside a residual branch.
func TestViTFreezeAndCuts(t *testing.T) {
	s, err := NewSpec(Config{Type: TypeViT, Patch: 2, Dim: 8, Depth: 4, Heads: 2, MLPRatio: 2}, []int{1, 4, 4}, 3)
	if err != nil {
		t.Fatal(err)
	}
	if s.Blocks() != 4 {
		t.Fatalf("%d blocks, want 4", s.Blocks())
	}
	frozen, err := FreezeConfig{Ratio: 0.75}.Frozen(s)
	if err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct {
		name string
		want bool
	}{
		{"patch_embed.proj.weight", true}, {"cls_token", true}, {"pos_embed", true},
		{"blocks.0.attn.qkv.weight", true}, {"blocks.2.mlp.fc2.bias", true},
		{"blocks.3.norm1.weight", false}, {"norm.weight", false}, {"head.weight", false},
	} {
		if frozen(tc.name) != tc.want {
			t.Errorf("%s frozen %v, want %v", tc.name, !tc.want, tc.want)
		}
	}
	depth := 0
	cuts := map[int]bool{}
	for _, c := range CutPoints(s) {
		cuts[c] = true
	}
	for i, l := range s.Layers {
		if cuts[i] && depth != 0 {
			t.Errorf("cut at layer %d (%s) inside a residual branch", i, l.Kind)
		}
		switch l.Kind {
		case Residual:
			depth++
		case Add:
			depth--
		}
	}
	segs, err := Segments(s, 4)
	if err != nil || len(segs) != 4 || segs[0] != 0 {
		t.Fatalf("segments %v, %v", segs, err)
	}
}
